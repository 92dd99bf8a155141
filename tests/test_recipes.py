"""Each SIZE=tiny recipe runs end to end on CPU and goes through every phase it stands for; a full-size recipe
stops at once without its GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

pytestmark = pytest.mark.e2e


ROOT = Path(__file__).resolve().parents[1]
TINY = {"aime": "li2sao", "retool": "lisao", "webshop": "sapo", "alfworld": "sapo"}
# the phases each tiny recipe stands for (async_rl.run_summary.phase_report), all of which must happen
EXPECTED_PHASES = {
    "aime": {"reward", "actor_updates", "critic_updates", "li2sao_switch"},
    "retool": {"reward", "actor_updates", "multi_turn", "tool_calls", "critic_updates"},
    "alfworld": {"reward", "actor_updates", "multi_turn", "sapo_value_losses"},
    "webshop": {"reward", "actor_updates", "multi_turn", "sapo_value_losses"},
}
FORCED_SWITCH_NOTE = "Li2SAO's switch was forced at T_max"


def _train(*args, cwd=ROOT, hide_gpu=False):
    env = {**os.environ, "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "1", "OMP_NUM_THREADS": "1"}
    if hide_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # a machine without a GPU, also where one is present
    return subprocess.run([sys.executable, "-m", "async_rl.train", "--config-dir", str(ROOT / "recipes"), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=900, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("task", sorted(TINY))
def test_tiny_recipe_goes_through_every_phase(task, tmp_path):
    out = _train("--config-name", f"{task}_tiny", f"algorithm={TINY[task]}", "trainer.wandb=false",
                 f"trainer.output_dir={tmp_path}", f"model.dir={tmp_path}/model")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    run_dir = tmp_path / f"{task}-tiny-{TINY[task]}"
    summary = json.loads((run_dir / "summary.json").read_text())
    phases = summary["phases"]
    assert EXPECTED_PHASES[task] <= set(phases), phases
    assert not [name for name, info in phases.items() if not info["ran"]], (phases, out.stdout[-3000:])
    assert phases["reward"]["steps_with_reward"] >= 1
    rewards = [json.loads(line).get("train/reward_mean", 0.0) for line in (run_dir / "metrics.jsonl").open()]
    assert max(rewards) > 0
    assert summary["warnings"] == [], summary["warnings"]
    if task == "aime":  # the gate opens on evidence before T_max (benchmarks/results/aime_tiny_gate.json)
        gate = OmegaConf.load(ROOT / "recipes" / "aime_tiny.yaml").algorithm.gate
        switch = phases["li2sao_switch"]
        assert switch["gate_opened_on_evidence"] is True, (switch, out.stdout[-3000:])
        assert gate.t_min + gate.patience - 1 <= switch["step"] < gate.t_max, switch  # the earliest it can open
        assert FORCED_SWITCH_NOTE not in out.stdout
    # the warm start used the task's own demonstrations, and they succeed only sometimes
    stats = json.loads((tmp_path / "model" / "sft" / "sft_stats.json").read_text())
    assert stats["env_names"] == [{"aime": "math"}.get(task, task)]
    assert 0.0 < stats["demo_success_rate"] < 1.0
    if task == "webshop":  # a whole purchase, not only partial scores (recipes/webshop_tiny.yaml: 2 seeds measured)
        assert max(json.loads(line).get("train/success_rate", 0.0) for line in (run_dir / "metrics.jsonl").open()) > 0
    if task == "retool":
        assert phases["tool_calls"]["count"] > 0 and stats["demo_code_turns_mean"] > 0.5
    # one progress display per phase (issue 38, item 5), in the output and in train.log: the warm start counts its
    # SFT steps, the build says what it starts, training counts its steps; each ends with its duration
    log = (run_dir / "train.log").read_text()
    total = summary["steps"]
    for text in (out.stdout, log):
        for line in (f"warm start: {stats['steps']}/{stats['steps']} steps loss", "warm start: done in",
                     "build: ", "build: done in", f"training: {total}/{total} steps acc", "training: done in"):
            assert line in text, (line, text[-3000:])


def test_full_recipe_without_gpu_names_the_tiny_variant():
    out = _train("--config-name", "aime", "algorithm=li2sao", hide_gpu=True)
    assert out.returncode != 0
    assert "SIZE=tiny" in out.stderr + out.stdout
