"""A new algorithm is one module (its estimator and its registration) and one YAML (issue 35): verl's registry is
the trainer's algorithm table. REINFORCE with a batch-mean baseline, written here as a user would write it outside
the package, composes through Hydra and trains through the driver; nothing in async_rl names it."""

import importlib
import sys
import textwrap

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from async_rl.train import REPO_CONF

pytestmark = pytest.mark.e2e

MODULE = '''
"""REINFORCE with a batch-mean baseline: A_i = R_i - mean_batch R on every model token of response i; no critic."""
from verl.trainer.ppo.core_algos import register_adv_est

from async_rl.algos.estimate import AdvantageEstimate
from async_rl.config import AlgorithmPlan, register_plan

CALLS = []


@register_adv_est("reinforce_baseline")
def reinforce_baseline(token_level_rewards, response_mask, scores=None, **unused):
    scores = token_level_rewards.sum(dim=-1) if scores is None else scores
    advantages = (scores - scores.mean()).unsqueeze(-1) * response_mask
    CALLS.append((scores.clone(), advantages.clone()))
    return AdvantageEstimate(advantages, advantages)


register_plan("reinforce", AlgorithmPlan("reinforce_baseline", "reinforce_baseline"))
'''

YAML = """
defaults:
  - _base
  - _self_

name: reinforce
group_size: 1
train_batch_trajectories: 8
actor_lr: 1.0e-3
policy_loss: ppo_clip
"""


def test_a_new_algorithm_is_one_module_and_one_yaml(tmp_path, monkeypatch, tiny_model):
    (tmp_path / "reinforce_algo.py").write_text(textwrap.dedent(MODULE))
    (tmp_path / "conf" / "algorithm").mkdir(parents=True)
    (tmp_path / "conf" / "algorithm" / "reinforce.yaml").write_text(YAML)
    monkeypatch.syspath_prepend(str(tmp_path))
    algo_module = importlib.import_module("reinforce_algo")  # what VERL_USE_EXTERNAL_MODULES=reinforce_algo does
    try:
        with initialize_config_dir(config_dir=REPO_CONF, version_base=None):
            cfg = compose(config_name="config", overrides=[
                "algorithm=reinforce", f"hydra.searchpath=[file://{tmp_path / 'conf'}]"])
        from async_rl.config import algorithm_config_from_dict
        from async_rl.assemble import RunSpec, build_deterministic_driver
        from async_rl.driver.driver import DriverConfig
        from async_rl.driver.episode import EpisodeLimits
        from async_rl.envs.toy import make_toy_tasks

        algo = algorithm_config_from_dict(OmegaConf.to_container(cfg.algorithm, resolve=True))
        assert algo.name == "reinforce" and algo.group_size == 1 and not algo.use_critic
        torch.set_num_threads(1)
        spec = RunSpec(model_path=str(tiny_model), env_name="toy_keys", tasks=make_toy_tasks("toy_keys", 32, 0),
                       max_new_tokens=6, limits=EpisodeLimits(max_turns=2, max_response_tokens=40))
        driver = build_deterministic_driver(algo, DriverConfig(total_steps=3, chunk_tokens=4, update_ticks=1), spec)
        history = driver.run()
    finally:
        sys.modules.pop("reinforce_algo", None)
        from verl.trainer.ppo import core_algos

        from async_rl import config as plans

        core_algos.ADV_ESTIMATOR_REGISTRY.pop("reinforce_baseline", None)
        plans.ALGORITHM_PLANS.pop("reinforce", None)

    assert len(history) == 3 and driver.learner.policy_version == 3  # three actor updates
    assert len(algo_module.CALLS) == 3
    for scores, advantages in algo_module.CALLS:
        assert scores.shape == (8,)
        # by hand: every model token of response i carries R_i minus the batch mean, so the per-response values
        # sum to zero over the batch
        per_response = advantages.abs().max(dim=1).values * torch.sign(scores - scores.mean())
        torch.testing.assert_close(per_response, scores - scores.mean())
    for row in history:
        assert all(v == v for k, v in row.items() if k.startswith("actor/") and isinstance(v, float))  # no NaN


def test_a_new_algorithm_trains_through_the_cli(tmp_path):
    """The same two files used as a user would: ``algorithm.module`` imports the module before the name is looked
    up, ``hydra.searchpath`` adds the YAML's folder; the run trains and logs the algorithm's name."""
    import json
    import os
    import subprocess
    from pathlib import Path

    (tmp_path / "reinforce_algo.py").write_text(textwrap.dedent(MODULE))
    (tmp_path / "algo_conf" / "algorithm").mkdir(parents=True)
    (tmp_path / "algo_conf" / "algorithm" / "reinforce.yaml").write_text(YAML)
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(repo / "src")]), "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "offline"}
    args = [sys.executable, "-m", "async_rl.train", "algorithm=reinforce", "algorithm.module=reinforce_algo",
            f"hydra.searchpath=[file://{tmp_path / 'algo_conf'}]", "model.sft.enabled=false", "model.hidden_size=32",
            "model.num_layers=1", f"model.dir={tmp_path}/model", "trainer.driver.total_steps=2", "trainer.wandb=false",
            "trainer.run_name=reinforce", "algorithm.overlong_penalty=false"]
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "outputs" / "reinforce"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["actor/updated"] == 1.0 for r in rows)
    assert json.loads((run_dir / "config.json").read_text())["algorithm"]["name"] == "reinforce"

    # without the module the name is unknown, and the one line says how to add it
    bad = subprocess.run(args[:4] + args[5:], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "algorithm.module" in bad.stderr.strip().splitlines()[-1]
