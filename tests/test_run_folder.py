"""One run per folder (issue 38, item 2): a run refuses a folder holding another run's outputs unless it
resumes or overwrites it; a lock keeps a second live run out, and the lock of a killed run is taken over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from async_rl.run_dir import LOCK_NAME, RunLock, check_run_dir, clear_outputs, run_outputs
from async_rl.validation import ConfigError

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO / "src")}


def _earlier_run(run_dir: Path, checkpoint: bool = False) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "summary.json").write_text("{}\n")
    (run_dir / "train.log").write_text("an earlier run's log\n")
    (run_dir / "eval").mkdir()
    (run_dir / "eval" / "summary.json").write_text("{}\n")
    if checkpoint:
        (run_dir / "checkpoints").mkdir()
        (run_dir / "checkpoints" / "step_000002.pt").write_bytes(b"x")


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_folder_with_another_runs_outputs_is_refused_unless_resumed_or_overwritten(tmp_path):
    run_dir = tmp_path / "run"
    check_run_dir(run_dir, resume=False, overwrite=False)  # no folder: fine
    run_dir.mkdir()
    (run_dir / "train.log").write_text("")  # Hydra's log of this very process
    (run_dir / "checkpoints").mkdir()  # empty
    assert run_outputs(run_dir) == []
    check_run_dir(run_dir, resume=False, overwrite=False)

    other = tmp_path / "other"
    _earlier_run(other)
    with pytest.raises(ConfigError) as caught:
        check_run_dir(other, resume=False, overwrite=False)
    assert str(caught.value) == (f"{other} holds the outputs of another run (eval/, metrics.jsonl, summary.json); "
                                 "continue it with trainer.resume=true, replace it with trainer.overwrite=true, or "
                                 "choose another trainer.run_name")
    with pytest.raises(ConfigError, match="holds no checkpoint to resume from"):
        check_run_dir(other, resume=True, overwrite=False)
    with pytest.raises(ConfigError, match="choose one"):
        check_run_dir(other, resume=True, overwrite=True)
    check_run_dir(other, resume=False, overwrite=True)
    (other / "checkpoints").mkdir()
    (other / "checkpoints" / "step_000001.pt").write_bytes(b"x")
    check_run_dir(other, resume=True, overwrite=False)


def test_overwrite_deletes_the_earlier_outputs_and_keeps_the_lock(tmp_path):
    run_dir = tmp_path / "run"
    _earlier_run(run_dir, checkpoint=True)
    lock = RunLock.acquire(run_dir)
    try:
        assert clear_outputs(run_dir) == ["checkpoints/", "eval/", "metrics.jsonl", "summary.json"]
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_NAME, "train.log"]
        assert (run_dir / "train.log").read_text() == ""
    finally:
        lock.release()
    assert not (run_dir / LOCK_NAME).exists()


HOLDER = textwrap.dedent("""
    import sys, time
    from async_rl.run_dir import RunLock
    RunLock.acquire(sys.argv[1])
    print("holding", flush=True)
    time.sleep(120)
""")


def _hold(run_dir: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], env=ENV, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    return holder


def test_a_live_run_keeps_the_folder_and_a_killed_runs_lock_is_taken_over(tmp_path, capsys):
    run_dir = tmp_path / "run"
    holder = _hold(run_dir)
    try:
        with pytest.raises(ConfigError, match=rf"{run_dir} is in use by another run \(pid {holder.pid} on "):
            RunLock.acquire(run_dir)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert (run_dir / LOCK_NAME).exists()  # a killed run leaves its lock file behind: stale
    lock = RunLock.acquire(run_dir)
    try:
        assert lock.took_over["pid"] == holder.pid
        assert f"took over the stale lock of pid {holder.pid}" in capsys.readouterr().out
        assert RunLock.acquire(run_dir) is lock  # idempotent within a process
    finally:
        lock.release()


def test_the_cli_refuses_a_live_runs_folder_and_a_finished_ones_in_one_line(tmp_path):
    run_dir = tmp_path / "out" / "x"
    _earlier_run(run_dir)
    before = _snapshot(run_dir)
    args = [sys.executable, "-m", "async_rl.train", f"trainer.output_dir={tmp_path}/out", "trainer.run_name=x"]
    started = time.perf_counter()
    done = subprocess.run(args, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and time.perf_counter() - started < 3.0, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: {run_dir} holds the outputs of another run (eval/, metrics.jsonl, summary.json); continue it with "
        "trainer.resume=true, replace it with trainer.overwrite=true, or choose another trainer.run_name"]
    assert _snapshot(run_dir) == before

    live = tmp_path / "out" / "live"
    holder = _hold(live)  # a run in progress (its outputs are not written yet)
    try:
        done = subprocess.run([*args[:-1], "trainer.run_name=live"], cwd=tmp_path, env=ENV, capture_output=True,
                              text=True, timeout=120)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().startswith(f"error: {live} is in use by another run (pid {holder.pid} on ")
    assert sorted(p.name for p in live.iterdir()) == [LOCK_NAME]  # no train.log: refused before Hydra started


def _model(folder: Path, step: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "async_rl": {
        "run_name": "r", "step": step, "exported_at": f"2026-12-06T10:0{step}:00+0000"}}))
    (folder / "model.safetensors").write_bytes(b"w" * (100 + step))
    return folder


def test_eval_results_record_their_model_and_plots_draw_only_the_runs_own(tmp_path, capsys):
    from async_rl.plots import load_pass_at_k
    from async_rl.run_dir import model_identity

    run_dir = tmp_path / "run"
    model = _model(run_dir / "model", step=4)
    identity = model_identity(model)
    assert identity["step"] == 4 and identity["run_name"] == "r" and len(identity["fingerprint"]) == 16
    (run_dir / "eval").mkdir()
    report = {"model_dir": str(model), "model": identity, "mean": {"k": [1, 2], "pass": [0.25, 0.5]}}
    (run_dir / "eval" / "pass_at_k.json").write_text(json.dumps(report))
    assert load_pass_at_k(run_dir) == {"k": [1, 2], "pass": [0.25, 0.5]}

    _model(run_dir / "model", step=6)  # the run resumed and exported a newer policy: the eval is of step 4
    assert model_identity(model)["fingerprint"] != identity["fingerprint"]
    assert load_pass_at_k(run_dir) is None
    printed = capsys.readouterr().out
    assert f"evaluates {model} (run r, step 4, exported 2026-12-06T10:04:00+0000), not this run's model" in printed
    other = _model(tmp_path / "elsewhere", step=6)  # same bytes elsewhere: another export would differ in its record
    assert model_identity(other)["fingerprint"] == model_identity(model)["fingerprint"]

    del report["model"]  # an evaluation that names no model is not drawn next to a run that has one
    (run_dir / "eval" / "pass_at_k.json").write_text(json.dumps(report))
    assert load_pass_at_k(run_dir) is None
    assert "records no model" in capsys.readouterr().out
