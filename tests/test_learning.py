"""Every algorithm learns the embedded multi-turn task under a fixed seed (deterministic scheduler).

The tiny model is warm-started by SFT on noisy demonstrations (~35 % success); the optimal policy
(look, then open the key) succeeds 100 %. A run is deterministic, so these thresholds do not flake.
"""

import pytest
import torch

from async_rl.config import AlgorithmConfig, GateConfig


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory):
    from async_rl.models.sft import sft_warm_start
    from async_rl.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("learn")
    base = make_tiny_model(root / "base")
    sft_warm_start(base, root / "sft", env_name="toy_keys", seed=0)
    return str(root / "sft")


ALGOS = {
    "grpo": dict(group_size=4, use_critic=False, policy_loss="ppo_clip"),
    "lisao": dict(group_size=1, use_critic=True, critic_warmup_steps=3, policy_loss="dis"),
    "li2sao": dict(group_size=4, use_critic=True, policy_loss="dis_clip",
                   gate=GateConfig(t_min=10, patience=3, t_max=20)),
    "ppo": dict(group_size=1, use_critic=True, gae_lambda=0.95, freeze_critic_attention=False,
                critic_updates_per_batch=1, policy_loss="ppo_clip"),
    "sapo": dict(group_size=1, use_critic=False, policy_loss="ppo_clip"),
}


@pytest.mark.parametrize("name", list(ALGOS))
def test_algorithm_learns_toy_keys(warm_model, name):
    import async_rl.envs.toy  # noqa: F401
    from async_rl.driver.build import RunSpec, build_deterministic_driver
    from async_rl.driver.driver import DriverConfig
    from async_rl.driver.episode import EpisodeLimits
    from async_rl.envs.toy import make_toy_tasks

    torch.set_num_threads(1)
    algo = AlgorithmConfig(name=name, train_batch_trajectories=32, actor_lr=1e-3, critic_lr=1e-3, **ALGOS[name])
    spec = RunSpec(model_path=warm_model, env_name="toy_keys", tasks=make_toy_tasks("toy_keys", 256, 0),
                   max_new_tokens=24, limits=EpisodeLimits(max_turns=4, max_response_tokens=160))
    driver = build_deterministic_driver(algo, DriverConfig(total_steps=36, max_inflight_trajectories=32), spec)
    history = driver.run()
    acc = [m["train/success_rate"] for m in history]
    first, last = sum(acc[:4]) / 4, sum(acc[-8:]) / 8
    assert last >= first + 0.25 and last >= 0.6, f"{name}: success {first:.2f} -> {last:.2f}: {acc}"
    if name == "li2sao":
        assert driver.stats.switch_step is not None and history[-1]["async/group_size"] == 1.0
