"""Every algorithm learns the embedded multi-turn task and does not collapse, on two seeds; Li2SAO's gate
opens on evidence before T_max, and a critic that cannot learn keeps it shut until T_max (issue 19).

The tiny model is warm-started by SFT on noisy demonstrations (~35 % success); the optimal policy (look, then
open the key) succeeds 100 %. Floating-point results differ between CPUs, so a run here and the same run on
another machine are two different runs: the tests assert properties that held for every seed measured, never
a trajectory. Settings sit inside the measured robust region (docs/algorithms.md, "Stability"): actor lr 3e-4
with staleness cap 4, where benchmarks/results/algorithms_toy.json has 25 of 25 runs (5 algorithms x 5 seeds)
at a last-8-steps success of 0.74 or more by step 28, none collapsing, and benchmarks/results/stability_map.json
has DIS at lr 3e-4, cap 4 never below 0.78 after reaching 0.9 (3 seeds; 0.75 on another machine's map). At actor
lr 1e-3 the same DIS runs fell below 0.5 after reaching 0.9 on 3 of 3 seeds, 2 of them collapsing (the map; on
the machine of commit 1c93eb5 2 of 3 dipped and none collapsed), which is why the old single-seed test at 1e-3
passed on one CPU and failed on another.
"""

import pytest
import torch

from async_rl.config import AlgorithmConfig, GateConfig
from async_rl.run_summary import collapse_step

# each run is a 28-step training (about 1-2 min on an idle 2-core machine, several under load): its own timeout
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

SEEDS = (0, 1)
STEPS = 28
ACTOR_LR = 3e-4  # the demo's; the robust region of the stability map
# Li2SAO's gate as in benchmarks/algorithms_toy.py for 40 steps: it opened at step 17-18 on 5 of 5 seeds
LI2SAO_GATE = GateConfig(t_min=10, patience=5, t_max=25)

ALGOS = {
    "grpo": dict(group_size=4, use_critic=False, policy_loss="ppo_clip"),
    "lisao": dict(group_size=1, use_critic=True, critic_warmup_steps=3, policy_loss="dis"),
    "li2sao": dict(group_size=4, use_critic=True, policy_loss="dis_clip", gate=LI2SAO_GATE),
    "ppo": dict(group_size=1, use_critic=True, gae_lambda=0.95, freeze_critic_attention=False,
                critic_updates_per_batch=1, policy_loss="ppo_clip"),
    "sapo": dict(group_size=1, use_critic=False, policy_loss="ppo_clip"),
}


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory):
    """The SFT warm start (tiny-model and SFT defaults, seed 0). ``ASYNC_RL_TEST_WARM_MODEL`` may name one already
    built with those defaults (``make demo`` leaves it in outputs/models/tiny-toy_keys/sft) to skip the SFT."""
    import os

    from async_rl.models.sft import sft_warm_start
    from async_rl.models.tiny import make_tiny_model

    given = os.environ.get("ASYNC_RL_TEST_WARM_MODEL")
    if given:
        if not os.path.exists(os.path.join(given, "config.json")):
            raise FileNotFoundError(f"ASYNC_RL_TEST_WARM_MODEL={given} holds no model (config.json); unset it to "
                                    "build the warm start here")
        return given
    root = tmp_path_factory.mktemp("learn")
    base = make_tiny_model(root / "base")
    sft_warm_start(base, root / "sft", env_name="toy_keys", seed=0)
    return str(root / "sft")


def _run(model, name, seed, steps, **overrides):
    import async_rl.envs.toy  # noqa: F401
    from async_rl.assemble import RunSpec, build_deterministic_driver
    from async_rl.driver.driver import DriverConfig
    from async_rl.driver.episode import EpisodeLimits
    from async_rl.envs.toy import make_toy_tasks

    torch.set_num_threads(1)
    kwargs = {"actor_lr": ACTOR_LR, "critic_lr": 1e-3, **ALGOS[name], **overrides}
    algo = AlgorithmConfig(name=name, train_batch_trajectories=32, **kwargs)
    spec = RunSpec(model_path=model, env_name="toy_keys", tasks=make_toy_tasks("toy_keys", 256, seed), seed=seed,
                   max_new_tokens=24, limits=EpisodeLimits(max_turns=4, max_response_tokens=160))
    driver = build_deterministic_driver(algo, DriverConfig(total_steps=steps, max_inflight_trajectories=32,
                                                           staleness_cap=4), spec)
    history = driver.run()
    return driver, history


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", list(ALGOS))
def test_algorithm_learns_toy_keys_without_collapse(warm_model, name, seed):
    driver, history = _run(warm_model, name, seed, STEPS)
    acc = [m["train/success_rate"] for m in history]
    first, last = sum(acc[:4]) / 4, sum(acc[-8:]) / 8
    curve = " ".join(f"{a:.2f}" for a in acc)
    # measured (algorithms_toy, 25 runs): first 4 steps 0.22-0.35, last 8 of 28 steps 0.74-0.90, gain >= 0.44
    assert last >= 0.6 and last >= first + 0.25, f"{name} seed {seed}: success {first:.2f} -> {last:.2f}: {curve}"
    assert collapse_step(acc) is None, f"{name} seed {seed} collapsed at step {collapse_step(acc)}: {curve}"
    if name == "li2sao":
        gate = driver.learner.gate
        # the gate opened on evidence (not forced at T_max): M consecutive steps with both EMAs over threshold
        assert driver.stats.switch_step is not None and not gate.forced, \
            f"seed {seed}: switch at {driver.stats.switch_step}, forced {gate.forced}, EMAs {gate.ema_e:.3f} / " \
            f"{gate.ema_a:.3f}"
        assert LI2SAO_GATE.t_min + LI2SAO_GATE.patience - 1 <= gate.switch_step < LI2SAO_GATE.t_max
        assert gate.consecutive >= LI2SAO_GATE.patience
        assert gate.ema_e > LI2SAO_GATE.eta_e and gate.ema_a > LI2SAO_GATE.eta_a
        opened = [m for m in history if m.get("li2sao/gate_opened")]
        assert len(opened) == 1 and opened[0]["li2sao/ema_explained_var"] > LI2SAO_GATE.eta_e \
            and opened[0]["li2sao/ema_rank_acc"] > LI2SAO_GATE.eta_a
        # every batch after the switch is single rollout
        after = history[gate.switch_step + 1:]
        assert after and all(m["async/group_size"] == 1.0 for m in after)


def test_li2sao_gate_stays_shut_until_t_max_when_the_critic_cannot_learn(warm_model):
    """A critic whose weights do not move (lr 1e-12: Adam steps of ~1e-12) never explains the residual returns,
    so ē_k stays under η_e and the switch happens only when T_max forces it."""
    gate_cfg = GateConfig(t_min=2, patience=2, t_max=8)
    driver, history = _run(warm_model, "li2sao", 0, 9, critic_lr=1e-12, gate=gate_cfg)
    gate = driver.learner.gate
    assert gate.switch_step == gate_cfg.t_max and gate.forced, (gate.switch_step, gate.forced)
    boot = [m for m in history if "li2sao/ema_explained_var" in m]
    assert len(boot) >= gate_cfg.t_max
    # the gate never counted a ready step: its counter stayed at 0 and ē_k never crossed η_e
    assert all(m["li2sao/gate_counter"] == 0.0 for m in boot)
    assert max(m["li2sao/ema_explained_var"] for m in boot) <= gate_cfg.eta_e
    # the statistics were defined (mixed groups existed): the gate was shut by the evidence, not by its absence
    assert sum(1 for m in boot if "li2sao/explained_var_residual" in m) >= gate_cfg.t_max // 2
