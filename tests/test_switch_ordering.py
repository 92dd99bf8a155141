"""Li2SAO switch ordering (spec §4), both schedulers: the version held while the prefetched job drains is
published before the first single-rollout request is launched, so no single rollout runs the pre-switch
policy. Every launch and publication is logged in order; the random tiny model never forms a mixed group,
so the gate opens at T_max = 3 and the held publication is version 3.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from async_rl.config import AlgorithmConfig, GateConfig
from async_rl.driver.driver import DriverConfig

SWITCH_VERSION = 3  # T_max = 3 bootstrap steps, each updates the actor once


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from async_rl.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=32, num_layers=1))


def _li2sao():
    return AlgorithmConfig(name="li2sao", train_batch_trajectories=8, group_size=4, use_critic=True,
                           actor_lr=1e-3, critic_lr=1e-3, policy_loss="dis_clip",
                           gate=GateConfig(t_min=1, patience=1, t_max=3))


def _spec(model_path):
    import async_rl.envs.toy  # noqa: F401
    from async_rl.assemble import RunSpec
    from async_rl.driver.episode import EpisodeLimits
    from async_rl.envs.toy import make_toy_tasks

    torch.set_num_threads(1)
    return RunSpec(model_path=model_path, env_name="toy_keys", tasks=make_toy_tasks("toy_keys", 64, 0),
                   max_new_tokens=6, limits=EpisodeLimits(max_turns=2, max_response_tokens=40))


def _log_events(driver, publish_delay_s: float = 0.0) -> list[tuple]:
    """Wrap the rollout's launches and the engine's publications; ``publish_delay_s`` stalls the held
    (switch) publication, which gives a rollout thread every chance to launch before it."""
    events: list[tuple] = []
    guard = threading.Lock()
    rollout, engine = driver.rollout, driver.rollout.engine
    launch, update = rollout.launch_prompt, engine.update_weights

    def logged_launch():
        with guard:
            events.append(("launch", rollout.group_size, engine.policy_version))
        return launch()

    def logged_update(weights, version, *args, **kwargs):
        if version == SWITCH_VERSION and publish_delay_s:
            time.sleep(publish_delay_s)
        update(weights, version, *args, **kwargs)
        with guard:
            events.append(("publish", version))

    rollout.launch_prompt = logged_launch
    engine.update_weights = logged_update
    return events


def _check_order(events: list[tuple]) -> None:
    published = [i for i, e in enumerate(events) if e == ("publish", SWITCH_VERSION)]
    singles = [i for i, e in enumerate(events) if e[0] == "launch" and e[1] == 1]
    assert published and singles, events
    assert singles[0] > published[0], f"a single-rollout request launched before version {SWITCH_VERSION} " \
                                      f"was published: {events[singles[0]]} at {singles[0]}, publish at {published[0]}"
    assert all(events[i][2] >= SWITCH_VERSION for i in singles)
    # and no group launch after the gate opened: every launch before the publication is a group launch
    assert all(e[1] == 4 for e in events[:published[0]] if e[0] == "launch")


def test_deterministic_publishes_the_switch_version_before_the_first_single_rollout(tiny_model):
    from async_rl.assemble import build_deterministic_driver

    # update_ticks = 8: the update's publication is due well after the short drain ends, the case where the
    # old ordering launched single rollouts on the pre-switch weights
    cfg = DriverConfig(total_steps=5, chunk_tokens=4, update_ticks=8, max_inflight_trajectories=24)
    driver = build_deterministic_driver(_li2sao(), cfg, _spec(tiny_model))
    events = _log_events(driver)
    driver.run()
    assert driver.stats.switch_step == 3 and driver.learner.phase == "single"
    _check_order(events)


def test_concurrent_publishes_the_switch_version_before_the_first_single_rollout(tiny_model):
    from async_rl.assemble import build_concurrent_driver

    cfg = DriverConfig(total_steps=5, chunk_tokens=4, max_inflight_trajectories=24)
    driver = build_concurrent_driver(_li2sao(), cfg, _spec(tiny_model))
    events = _log_events(driver, publish_delay_s=0.5)
    driver.run()
    assert driver.stats.switch_step == 3 and driver.learner.phase == "single"
    _check_order(events)
