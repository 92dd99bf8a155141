"""Resume and its logs (issue 13, item 3): a run killed with SIGKILL and resumed logs every step exactly
once; a truncated or corrupt newest checkpoint is skipped for the previous one, with a message; a resume
that fails changes no file; stale ``*.tmp`` files are cleaned; only ``keep_last`` checkpoints are kept.

The file-level rules run on small state dicts (fast); the end-to-end tests train a random tiny model
through the real CLI entry point (``python -m async_rl.train``) in subprocesses.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from async_rl.driver.checkpoint import (CheckpointError, list_checkpoints, load_newest_good, prune_checkpoints,
                                        read_checkpoint, write_checkpoint)
from async_rl.tracking import RunLogger, rows_up_to
from cli_hooks import SIGNAL, TORN_WRITE_THEN_KILL, cli_after_step

pytestmark = pytest.mark.e2e


REPO = Path(__file__).resolve().parents[1]


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _state(step: int) -> dict:
    return {"format": 1, "step": step, "weights": torch.full((4,), float(step))}


# ------------------------------------------------------------------------------------------------------
# checkpoint files
# ------------------------------------------------------------------------------------------------------
def test_write_checkpoint_is_complete_with_a_sha256sum_checksum_and_cleans_stale_tmp(tmp_path):
    (tmp_path / "step_000009.pt.tmp").write_bytes(b"half a checkpoint from a killed save")
    path = write_checkpoint(_state(2), tmp_path, 2)
    assert path.name == "step_000002.pt"
    # the checksum file is what `sha256sum -c` reads: "<hex>  <name>"
    digest, name = (tmp_path / "step_000002.pt.sha256").read_text().split()
    assert name == "step_000002.pt" and digest == hashlib.sha256(path.read_bytes()).hexdigest()
    assert (tmp_path / "latest").read_text().strip() == "step_000002.pt"
    assert not list(tmp_path.glob("*.tmp")), "a stale .tmp file survived the next save"
    state, problem = read_checkpoint(path)
    assert problem is None and torch.equal(state["weights"], torch.full((4,), 2.0))


@pytest.mark.parametrize("damage", ["truncate", "flip_byte", "empty"])
def test_damaged_checkpoint_is_detected_by_its_checksum(tmp_path, damage):
    path = write_checkpoint(_state(3), tmp_path, 3)
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flip_byte":  # same size, one byte of the tensor data changed: only a checksum sees it
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:])
    else:
        path.write_bytes(b"")
    state, problem = read_checkpoint(path)
    assert state is None and "checksum mismatch" in problem


def test_checkpoint_without_checksum_gets_the_load_check(tmp_path):
    # checkpoints written before checksums existed: a complete one loads, a truncated one is caught by torch.load
    path = write_checkpoint(_state(1), tmp_path, 1)
    (tmp_path / "step_000001.pt.sha256").unlink()
    assert read_checkpoint(path)[1] is None
    path.write_bytes(path.read_bytes()[:100])
    state, problem = read_checkpoint(path)
    assert state is None and problem.startswith("torch.load failed")
    assert read_checkpoint(tmp_path / "step_000042.pt")[1] == "file not found"


def test_prune_keeps_the_newest_keep_last_up_to_the_current_step(tmp_path):
    for step in (1, 2, 3, 4, 6):
        write_checkpoint(_state(step), tmp_path, step)
    # current step 4, keep 2: steps 3 and 4 stay; 1 and 2 go with their checksums; step 6 (a later
    # checkpoint of a run resumed from an earlier one) is left for the run to overwrite
    removed = prune_checkpoints(tmp_path, current_step=4, keep_last=2)
    assert sorted(p.name for p in removed) == ["step_000001.pt", "step_000002.pt"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4, 6]
    assert sorted(p.name for p in tmp_path.glob("*.sha256")) == [
        "step_000003.pt.sha256", "step_000004.pt.sha256", "step_000006.pt.sha256"]


def test_newest_damaged_checkpoint_falls_back_to_the_previous_with_a_message(tmp_path):
    for step in (2, 4):
        write_checkpoint(_state(step), tmp_path, step)
    newest = tmp_path / "step_000004.pt"
    newest.write_bytes(newest.read_bytes()[:50])
    (tmp_path / "step_000006.pt.tmp").write_bytes(b"torn")
    loaded, lines = [], []
    path = load_newest_good(tmp_path, loaded.append, log=lines.append)
    assert path.name == "step_000002.pt" and loaded[0]["step"] == 2
    assert "step_000004.pt is unusable: checksum mismatch" in lines[0]
    assert "previous good checkpoint step_000002.pt" in lines[1]
    # the damaged one is set aside (never loaded or pruned again), latest names the one in use, .tmp gone
    assert (tmp_path / "step_000004.pt.corrupt").exists() and not newest.exists()
    assert (tmp_path / "latest").read_text().strip() == "step_000002.pt"
    assert not list(tmp_path.glob("*.tmp"))


def test_resume_with_no_usable_checkpoint_fails_and_changes_no_file(tmp_path):
    for step in (2, 4):
        path = write_checkpoint(_state(step), tmp_path, step)
        path.write_bytes(path.read_bytes()[:64])
    (tmp_path / "step_000005.pt.tmp").write_bytes(b"torn")
    before = _snapshot(tmp_path)
    with pytest.raises(CheckpointError, match="no usable checkpoint.*step_000004.pt: checksum mismatch"):
        load_newest_good(tmp_path, lambda state: None, log=lambda line: None)
    assert _snapshot(tmp_path) == before
    assert load_newest_good(tmp_path / "absent", lambda state: None) is None  # no checkpoint at all: fresh run


# ------------------------------------------------------------------------------------------------------
# metrics.jsonl on resume
# ------------------------------------------------------------------------------------------------------
def test_resumed_logger_keeps_rows_up_to_the_checkpoint_and_appends_after(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [{"step": s, "x": float(s)} for s in (1, 2, 3, 2, 4, 5)]  # step 2 twice (an older resume)
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "x":'  # row 6 torn by the kill
    (run_dir / "metrics.jsonl").write_text(text)
    (run_dir / "metrics.jsonl.tmp").write_text("stale")
    # checkpoint at step 4; its history also holds step 1..4 (used only for steps the file lacks)
    history = [{"trainer/step": float(s), "x": 100.0 + s} for s in range(1, 5)]
    logger = RunLogger(run_dir, "p", "r", {}, use_wandb=False, resume_step=4, history=history)
    logger.log({"x": 50.0}, step=5)
    logger.close()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # steps 1-4 from the file (step 2's first row), step 5 rewritten by the resumed run, torn row 6 gone
    assert lines == [{"step": 1, "x": 1.0}, {"step": 2, "x": 2.0}, {"step": 3, "x": 3.0}, {"step": 4, "x": 4.0},
                     {"step": 5, "x": 50.0}]
    assert not (run_dir / "metrics.jsonl.tmp").exists()


def test_rows_missing_from_the_file_come_from_the_checkpoint_history(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 2, "x": 2.0}) + "\n")
    history = [{"trainer/step": 1, "x": 11.0, "note": "text is dropped as in log()"}, {"trainer/step": 2, "x": 12.0},
               {"trainer/step": 3, "x": 13.0}]
    # a history row becomes what log() would have written: "step" first, numbers only
    assert rows_up_to(tmp_path / "metrics.jsonl", 3, history) == [
        {"step": 1, "trainer/step": 1.0, "x": 11.0}, {"step": 2, "x": 2.0}, {"step": 3, "trainer/step": 3.0, "x": 13.0}]
    assert [r["x"] for r in rows_up_to(tmp_path / "absent.jsonl", 2, history)] == [11.0, 12.0]


def test_fresh_logger_starts_an_empty_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    RunLogger(tmp_path, "p", "r", {"a": 1}, use_wandb=False).close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    assert json.loads((tmp_path / "config.json").read_text()) == {"a": 1}


# ------------------------------------------------------------------------------------------------------
# end to end: the CLI killed with SIGKILL, resumed
# ------------------------------------------------------------------------------------------------------
# Runs the CLI with RunLogger.log wrapped: after logging step KILL_AT it writes half of the next row
# (as a kill in the middle of a write would leave it) and SIGKILLs its own process.
KILLER = cli_after_step(TORN_WRITE_THEN_KILL)


def _overrides(tmp_path, run_name, *extra):
    return ["algorithm=grpo", "algorithm.train_batch_trajectories=8", "algorithm.group_size=4",
            "model.sft.enabled=false", "model.hidden_size=32", "model.num_layers=1", f"model.dir={tmp_path}/model",
            f"trainer.output_dir={tmp_path}/out", f"trainer.run_name={run_name}", "trainer.wandb=false",
            "trainer.export_model=false", "trainer.driver.total_steps=6", "trainer.driver.checkpoint_every=2",
            "trainer.driver.keep_last=2", "env.max_new_tokens=6", "env.max_response_tokens=40", *extra]


def _cli(args, kill_at=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    if kill_at is None:
        command = [sys.executable, "-m", "async_rl.train", *args]
    else:
        env["AT_STEP"] = str(kill_at)
        command = [sys.executable, "-c", KILLER, *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _comparable(rows):  # wall-clock keys aside, a resumed deterministic run logs the same numbers
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("resume")
    done = _cli(_overrides(tmp_path, "straight"))
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp_path, _rows(tmp_path / "out" / "straight")


@pytest.fixture(scope="module")
def killed(uninterrupted):
    """The run killed with SIGKILL right after logging step 5: checkpoints at steps 2 and 4, rows 1-5 and a
    torn half row 6 on disk. Each test resumes its own copy."""
    tmp_path, _ = uninterrupted
    run = _cli(_overrides(tmp_path, "killed"), kill_at=5)
    assert run.returncode == -9, run.stderr[-3000:]
    run_dir = tmp_path / "out" / "killed"
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [2, 4]
    assert [r["step"] for r in _rows_lenient(run_dir)] == [1, 2, 3, 4, 5]
    assert (run_dir / "metrics.jsonl").read_text().endswith('{"step": 6, "actor/')
    return run_dir


def _rows_lenient(run_dir):
    return rows_up_to(run_dir / "metrics.jsonl", 10 ** 9)


def _copy_of(killed, name):
    target = killed.parent / name
    shutil.copytree(killed, target)
    return target


def test_killed_run_resumes_with_every_step_logged_exactly_once(uninterrupted, killed):
    tmp_path, straight = uninterrupted
    run_dir = _copy_of(killed, "resumed")
    resumed = _cli(_overrides(tmp_path, "resumed", "trainer.resume=true"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step_000004.pt at step 4" in resumed.stdout
    # the training display counts on from the checkpoint's step (its first line: step 5 of 6)
    assert "training: 5/6 steps acc" in resumed.stdout and "training: 1/6 steps" not in resumed.stdout
    assert "training: 6/6 steps acc" in (run_dir / "train.log").read_text()
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    # row 5 was dropped and redone, rows 1-4 kept: the same numbers as the uninterrupted run
    assert _comparable(rows) == _comparable(straight)
    # keep_last=2: the resumed run's checkpoints at 4 and 6 remain, step 2 was pruned
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [4, 6]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 6


def test_truncated_latest_checkpoint_resumes_from_the_previous_one(uninterrupted, killed):
    tmp_path, straight = uninterrupted
    run_dir = _copy_of(killed, "truncated")
    latest = run_dir / "checkpoints" / "step_000004.pt"
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 3])  # e.g. the disk filled up

    resumed = _cli(_overrides(tmp_path, "truncated", "trainer.resume=true"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step_000004.pt is unusable: checksum mismatch" in resumed.stdout
    assert "step_000002.pt at step 2" in resumed.stdout
    # rows 3-5 of the killed run were dropped and redone: each step once, the same numbers as straight
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert _comparable(rows) == _comparable(straight)
    assert (run_dir / "checkpoints" / "step_000004.pt.corrupt").exists()
    assert read_checkpoint(latest)[1] is None  # rewritten whole by the resumed run


def test_failed_resume_leaves_every_file_byte_identical(uninterrupted, killed):
    tmp_path, _ = uninterrupted
    run_dir = _copy_of(killed, "broken")
    for step in (2, 4):
        path = run_dir / "checkpoints" / f"step_{step:06d}.pt"
        path.write_bytes(path.read_bytes()[:1000])
    (run_dir / "checkpoints" / "step_000006.pt.tmp").write_bytes(b"a save the kill interrupted")
    before = _snapshot(run_dir)

    failed = _cli(_overrides(tmp_path, "broken", "trainer.resume=true"))
    assert failed.returncode == 1
    last_line = failed.stderr.strip().splitlines()[-1]  # after the model-loading progress bars
    assert last_line.startswith("error: no usable checkpoint") and "Traceback" not in failed.stderr
    assert "step_000004.pt: checksum mismatch" in last_line and "step_000002.pt: checksum mismatch" in last_line
    # every file of the run is as it was; the log only gains the attempt's lines (its last: the error), and the
    # killed run's stale lock was taken over and given back
    after = _snapshot(run_dir)
    log_before, log_after = before.pop("train.log"), after.pop("train.log")
    assert log_after.startswith(log_before) and log_after.decode().rstrip().endswith(last_line)
    assert ".lock" in before and ".lock" not in after
    before.pop(".lock")
    assert after == before


def test_fresh_run_refuses_to_mix_its_checkpoints_with_an_earlier_runs(uninterrupted):
    tmp_path, _ = uninterrupted
    run_dir = tmp_path / "out" / "straight"
    before = _snapshot(run_dir)
    again = _cli(_overrides(tmp_path, "straight"))
    assert again.returncode == 2
    assert again.stderr.strip() == (f"error: {run_dir} holds the outputs of another run (checkpoints/, config.json, "
                                    "metrics.jsonl, summary.json, training.png); continue it with trainer.resume=true, "
                                    "replace it with trainer.overwrite=true, or choose another trainer.run_name")
    assert _snapshot(run_dir) == before


def test_each_checkpoint_exports_the_policy_so_a_killed_run_has_a_model(tmp_path):
    """Issue 11 item 6: the model directory is written at every checkpoint, not only at the end."""
    from async_rl.models.export import exported_model_info

    run = _cli(_overrides(tmp_path, "exported", "trainer.export_model=true"), kill_at=3)
    assert run.returncode == -9, run.stderr[-3000:]
    model_dir = tmp_path / "out" / "exported" / "model"
    assert (model_dir / "config.json").exists()
    assert exported_model_info(model_dir)["step"] == 2  # the checkpoint at step 2; the run died after step 3


# ------------------------------------------------------------------------------------------------------
# end to end: the CLI stopped with SIGINT / SIGTERM (issue 38, item 1), resumed
# ------------------------------------------------------------------------------------------------------
# Runs the CLI with RunLogger.log wrapped: after logging step AT_STEP it sends itself SIGNAL (once, or
# twice with SIGNAL_TWICE: the second one stops at once).
SIGNALLER = cli_after_step(SIGNAL)


def _signalled(args, at_step, sig="SIGINT", twice=False):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "AT_STEP": str(at_step),
           "SIGNAL": sig, **({"SIGNAL_TWICE": "1"} if twice else {})}
    return subprocess.run([sys.executable, "-c", SIGNALLER, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("sig,status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_ends_the_run_in_one_line_with_a_checkpoint_and_resume_matches(uninterrupted, sig, status):
    tmp_path, straight = uninterrupted
    name = f"stopped-{sig.lower()}"
    # checkpoint_every=2: step 3 has no periodic checkpoint, so the one on disk is the final one the signal wrote
    stopped = _signalled(_overrides(tmp_path, name), at_step=3, sig=sig)
    assert stopped.returncode == status, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr + stopped.stdout
    last = stopped.stderr.strip().splitlines()[-1]
    run_dir = tmp_path / "out" / name
    assert last.startswith(f"interrupted by {sig} at step 3; checkpoint {run_dir / 'checkpoints' / 'step_000003.pt'}; "
                           "resume with: python -m async_rl.train algorithm=grpo ")
    assert f" trainer.run_name={name} " in last and last.endswith(" env.max_response_tokens=40 trainer.resume=true")
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [2, 3]
    assert [r["step"] for r in _rows(run_dir)] == [1, 2, 3]
    assert not (run_dir / "summary.json").exists()

    resumed = _cli(_overrides(tmp_path, name, "trainer.resume=true"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step_000003.pt at step 3" in resumed.stdout
    assert _comparable(_rows(run_dir)) == _comparable(straight)  # the same numbers as the uninterrupted run


def test_a_second_signal_stops_at_once_and_names_the_newest_checkpoint(uninterrupted):
    tmp_path, _ = uninterrupted
    stopped = _signalled(_overrides(tmp_path, "twice"), at_step=3, twice=True)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith("interrupted by SIGINT at step 3 (second signal: stopped at once); checkpoint ")
    assert "step_000002.pt; resume with:" in last and "Traceback" not in stopped.stderr
    assert [s for s, _ in list_checkpoints(tmp_path / "out" / "twice" / "checkpoints")] == [2]
