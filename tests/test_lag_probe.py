"""benchmarks/lag_probe.py: the long-tail benchmark's split of policy lag and step time (issue 22)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from async_rl.config import AlgorithmConfig
from async_rl.driver.driver import DriverConfig
from async_rl.driver.trajectory import Segment, Trajectory


def _traj(uid, group, versions, group_size):
    return Trajectory(uid=uid, group_id=group, prompt_index=0, prompt_ids=[1], group_size=group_size,
                      segments=[Segment("model", [5] * len(versions), [0.0] * len(versions), list(versions))])


def _driver(trainer, engine):
    return SimpleNamespace(learner=SimpleNamespace(policy_version=trainer),
                           rollout=SimpleNamespace(engine=SimpleNamespace(policy_version=engine)))


def test_components_by_hand(load_benchmark):
    lp = load_benchmark("lag_probe")
    probe = lp.LagProbe()
    a = _traj("g/r0", "g", [0, 0, 1], 2)  # finishes at engine version 1, waits for its sibling
    b = _traj("g/r1", "g", [1, 2, 2, 3], 2)  # finishes at 3: the group is released then
    probe.on_intake(_driver(1, 1), a, added=True, released=False)
    probe.on_intake(_driver(3, 3), b, added=True, released=True)
    probe.on_batch(_driver(5, 4), [a, b])  # taken at engine 4 while an update to 5 is in flight
    lags = [5 - v for v in [0, 0, 1, 1, 2, 2, 3]]
    gen = [1 - v for v in [0, 0, 1]] + [3 - v for v in [1, 2, 2, 3]]
    got = probe.batch_components[0]
    assert got["generation"] == pytest.approx(sum(gen) / 7)
    assert got["group_wait"] == pytest.approx(3 * (3 - 1) / 7)  # a's 3 tokens waited 2 versions
    assert got["batch_wait"] == pytest.approx(1.0)
    assert got["update_in_flight"] == pytest.approx(1.0)
    summary = probe.summary(capacity=8, steps=1, ticks=None, generated_tokens=7)
    assert summary["mean_policy_lag"] == pytest.approx(sum(lags) / 7)
    assert summary["lag_components_sum"] == pytest.approx(sum(lags) / 7)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from async_rl.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=32, num_layers=1))


def _run(model_path, group_size, **driver_kw):
    import async_rl.envs.toy  # noqa: F401
    from async_rl.assemble import RunSpec, build_deterministic_driver
    from async_rl.driver.episode import EpisodeLimits
    from async_rl.envs.toy import LONG_TAIL_DEFAULT, make_toy_tasks

    torch.set_num_threads(1)
    long_tail = {**LONG_TAIL_DEFAULT, "max": 40}
    spec = RunSpec(model_path=model_path, env_name="toy_keys",
                   tasks=make_toy_tasks("toy_keys", 64, 0, long_tail=long_tail), seed=0,
                   max_new_tokens=6, limits=EpisodeLimits(max_turns=3, max_response_tokens=80))
    algo = AlgorithmConfig(name="grpo", train_batch_trajectories=8, group_size=group_size, actor_lr=1e-3) \
        if group_size > 1 else AlgorithmConfig(name="lisao", train_batch_trajectories=8, group_size=1,
                                               use_critic=True, policy_loss="dis", critic_warmup_steps=0,
                                               actor_lr=1e-3, critic_lr=1e-3)
    cfg = DriverConfig(total_steps=5, chunk_tokens=4, update_ticks=1, max_inflight_trajectories=8, **driver_kw)
    driver = build_deterministic_driver(algo, cfg, spec)
    history = driver.run()
    return driver, history


@pytest.mark.parametrize("group_size", [1, 4])
def test_a_probed_run_is_the_same_run_and_its_parts_add_up(load_benchmark, tiny_model, group_size):
    lp = load_benchmark("lag_probe")
    plain_driver, plain = _run(tiny_model, group_size)
    with lp.probe() as measured:
        driver, probed = _run(tiny_model, group_size)
    keys = ("async/policy_lag/mean", "async/clock_ticks", "train/reward_mean", "train/response_length/mean")
    assert [[m[k] for k in keys] for m in probed] == [[m[k] for k in keys] for m in plain]
    assert driver.clock == plain_driver.clock

    summary = measured.summary(8, len(probed), driver.clock, driver.rollout.generated_tokens)
    run_lag = sum(m["async/policy_lag/mean"] for m in probed) / len(probed)
    assert summary["batches"] == len(probed)
    assert summary["mean_policy_lag"] == pytest.approx(run_lag, abs=1e-9)
    parts = summary["lag_components"]
    assert all(v >= 0 for v in parts.values())
    assert parts["update_in_flight"] == 0.0  # the deterministic trainer takes a batch only while idle
    if group_size == 1:
        assert parts["group_wait"] == 0.0
    else:  # each member draws its own forced length: finished members wait for the longest
        assert parts["group_wait"] > 0.0
    assert 0 < summary["slots"]["slot_occupancy"] <= 1.0
    f = summary["step_time"]
    assert f["tokens_generated_per_step"] / f["tokens_per_busy_tick"] / f["busy_ticks_frac"] == \
        pytest.approx(f["ticks_per_step"])

    # the probe is closed again: a later run is not measured
    before = measured.chunks
    _run(tiny_model, group_size)
    assert measured.chunks == before


def test_launches_the_buffer_has_no_room_for_are_counted(load_benchmark, tiny_model):
    lp = load_benchmark("lag_probe")
    with lp.probe() as roomy:
        _run(tiny_model, 4)
    # the smallest buffer allowed (B + n - 1) counts the live trajectories against it: groups wait for room
    with lp.probe() as tight:
        _run(tiny_model, 4, buffer_capacity=11)
    assert roomy.summary(8, 5, None, 0)["slots"]["launches_refused_for_room"] == 0
    assert tight.summary(8, 5, None, 0)["slots"]["launches_refused_for_room"] > 0
