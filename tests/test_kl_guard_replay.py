"""benchmarks/kl_guard_replay.py counts warnings, dips and false alarms the way docs/algorithms.md states them.

Hand-made runs: the replay must feed the series through the trainer's own KLGuard (critic-only steps have no KL,
the kept-token rule applies only where a run reports ``actor/dis_kept_kl``), call a dip warned only when the first
warning comes at an earlier step, and leave the lag-0 copies out.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def replay_module(load_benchmark):
    return load_benchmark("kl_guard_replay")


def _run(loss, lr, seed, success, kl, kept=None, derived_from=None):
    return {"loss": loss, "actor_lr": lr, "staleness_cap": 4, "seed": seed, "derived_from": derived_from,
            "series": {"success": success, "kl": kl, "kept_kl": kept or [None] * len(kl)}}


def test_dip_step_is_the_first_step_below_half_after_reaching_0_9(replay_module):
    assert replay_module.dip_step([0.3, 0.92, 0.6, 0.45, 0.2]) == 4
    assert replay_module.dip_step([0.3, 0.4, 0.2]) is None  # never reached 0.9: no dip
    assert replay_module.dip_step([0.3, 0.95, 0.7, 0.9]) is None
    assert replay_module.dip_step([0.9, None, 0.8]) == 2  # a missing value counts as 0, as in the map


def test_first_warning_skips_critic_only_steps_and_applies_the_kept_rule(replay_module):
    run = _run("dis", 1e-3, 0, [0.5] * 5, kl=[None, 0.05, 0.3, 0.2, 0.15], kept=[None, 0.01, 0.01, 0.03, 0.05])
    assert replay_module.first_warning(run, 0.1, 0.0) == 3
    assert replay_module.first_warning(run, 0.1, 0.02) == 4  # step 3's spike sat on masked tokens
    assert replay_module.first_warning(run, 0.1, 0.04) == 5
    assert replay_module.first_warning(run, 0.0, 0.0) is None  # threshold 0 turns the guard off
    clipped = _run("ppo_clip", 1e-3, 0, [0.5] * 3, kl=[None, 0.2, 0.05])
    assert replay_module.first_warning(clipped, 0.1, 0.02) == 2  # no kept-token series: actor/ppo_kl alone


def test_replay_counts_warned_missed_and_false_alarms(replay_module):
    payload = {"runs": [
        # warned at 2, dipped at 4: warned, lead 2
        _run("dis", 1e-3, 0, [0.5, 0.95, 0.7, 0.3, 0.2], kl=[0.01, 0.3, 0.4, 0.5, 0.5]),
        # warned at the dip's own step: missed
        _run("dis", 1e-3, 1, [0.5, 0.95, 0.3, 0.3, 0.2], kl=[0.01, 0.05, 0.3, 0.5, 0.5]),
        # warned, never dipped: a false alarm
        _run("ppo_clip", 3e-4, 0, [0.5, 0.95, 0.9, 0.9, 0.9], kl=[0.01, 0.2, 0.05, 0.05, 0.05]),
        # quiet and steady
        _run("ppo_clip", 1e-3, 0, [0.5, 0.6, 0.7, 0.8, 0.9], kl=[0.01] * 5),
        # a lag-0 copy would be a false alarm if it were counted
        _run("dis", 3e-4, 0, [0.5, 0.95, 0.9, 0.9, 0.9], kl=[0.01, 0.2, 0.05, 0.05, 0.05], derived_from="x"),
    ]}
    result = replay_module.replay(payload, 0.1, 0.0)
    assert result["trained_runs"] == 4 and result["runs_warned"] == 3
    assert result["dips"] == 2 and result["dips_warned"] == 1
    assert result["missed_dips"] == ["dis lr=0.001 k=4 seed=1"]
    assert [d["lead_steps"] for d in result["dip_runs"]] == [2, None]
    assert result["false_alarms"] == [{"run": "ppo_clip lr=0.0003 k=4 seed=0", "first_warning_step": 2}]
    assert result["warned_at_lr_3e-4"] == ["ppo_clip lr=0.0003 k=4 seed=0"]
