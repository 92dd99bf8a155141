"""The KL guard (issue 19): a WARNING line and ``actor/kl_warning`` when ``actor/ppo_kl`` exceeds
``algorithm.kl_warn_threshold``; the collapse rule of the stability map; the run summary's warning."""

import io

import pytest

from async_rl.config import AlgorithmConfig
from async_rl.driver.kl_guard import KLGuard
from async_rl.run_summary import collapse_step, phase_report
from async_rl.validation import ConfigError


def test_guard_warns_over_the_threshold_only():
    out = io.StringIO()
    guard = KLGuard(0.1, stream=out)
    assert guard.check(12, {"actor/ppo_kl": 0.05, "actor/updated": 1.0}) == {"actor/kl_warning": 0.0}
    assert out.getvalue() == ""
    # exactly at the threshold is not over it
    assert guard.check(13, {"actor/ppo_kl": 0.1, "actor/updated": 1.0}) == {"actor/kl_warning": 0.0}
    metrics = {"actor/ppo_kl": 0.68, "actor/updated": 1.0, "async/policy_lag/mean": 3.5}
    assert guard.check(21, metrics) == {"actor/kl_warning": 1.0}
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith("WARNING: step 21: actor/ppo_kl 0.6800 > algorithm.kl_warn_threshold 0.1")
    assert "mean policy lag 3.50" in line
    for hint in ("algorithm.actor_lr", "trainer.driver.staleness_cap"):
        assert hint in line
    assert guard.warned_steps == [21]
    # not a DIS loss (a clipped one, e.g. GRPO): no kept-token KL to report, no DIS collapse to name
    assert "dis_kept_kl" not in line and "DIS" not in line and "dis_clip" not in line


def test_warning_reports_the_kept_token_kl_of_dis_losses():
    out = io.StringIO()
    KLGuard(0.1, stream=out).check(56, {"actor/ppo_kl": 0.169, "actor/dis_kept_kl": 0.011, "actor/updated": 1.0})
    assert "actor/dis_kept_kl 0.0110 on the tokens inside the DIS band" in out.getvalue()
    line = out.getvalue()
    for hint in ("the regime where DIS collapsed", "algorithm.actor_lr", "trainer.driver.staleness_cap",
                 "algorithm.policy_loss=dis_clip"):
        assert hint in line


def test_guard_is_silent_without_an_actor_update_or_when_off():
    out = io.StringIO()
    guard = KLGuard(0.1, stream=out)
    assert guard.check(3, {"actor/updated": 0.0}) == {}  # LiSAO warm-up: no KL, no metric
    assert guard.check(4, {"actor/ppo_kl": 5.0, "actor/updated": 0.0}) == {}
    assert guard.check(5, {"actor/ppo_kl": float("nan"), "actor/updated": 1.0}) == {}
    off = KLGuard(0.0, stream=out)
    assert off.check(6, {"actor/ppo_kl": 5.0, "actor/updated": 1.0}) == {}
    assert out.getvalue() == ""
    with pytest.raises(ValueError, match="kl_warn_threshold"):
        KLGuard(-0.1)


def test_threshold_is_a_validated_config_key():
    assert AlgorithmConfig().kl_warn_threshold == 0.1
    with pytest.raises(ConfigError, match="algorithm.kl_warn_threshold"):
        AlgorithmConfig(kl_warn_threshold=-1.0).validate()


def test_collapse_rule():
    # reaches 0.9 at step 2, then five steps below 0.5 from step 3
    assert collapse_step([0.2, 0.9, 0.4, 0.4, 0.4, 0.4, 0.4, 0.6]) == 3
    # only four low steps: no collapse
    assert collapse_step([0.2, 0.9, 0.4, 0.4, 0.4, 0.4, 0.6]) is None
    # a streak broken by a recovery restarts
    assert collapse_step([0.95, 0.1, 0.1, 0.6, 0.1, 0.1, 0.1, 0.1, 0.1]) == 5
    # low before ever reaching 0.9 is not a collapse (a run that never learned)
    assert collapse_step([0.1] * 10) is None
    assert collapse_step([0.1] * 6 + [0.9]) is None


def test_summary_names_the_kl_warnings():
    history = [{"trainer/step": 1.0, "actor/updated": 0.0, "train/reward_mean": 0.2},
               {"trainer/step": 2.0, "actor/updated": 1.0, "actor/ppo_kl": 0.02, "actor/kl_warning": 0.0,
                "train/reward_mean": 0.3},
               {"trainer/step": 3.0, "actor/updated": 1.0, "actor/ppo_kl": 0.3, "actor/kl_warning": 1.0,
                "train/reward_mean": 0.3},
               {"trainer/step": 4.0, "actor/updated": 1.0, "actor/ppo_kl": 0.5, "actor/kl_warning": 1.0,
                "train/reward_mean": 0.3}]
    warnings = phase_report(history, "grpo", "toy_echo")["warnings"]
    kl = [w for w in warnings if "kl_warn_threshold" in w]
    assert kl == ["actor/ppo_kl exceeded algorithm.kl_warn_threshold on 2 of 3 actor updates (first at step 3, "
                  "peak 0.500): lower algorithm.actor_lr or trainer.driver.staleness_cap"]
    assert not [w for w in phase_report(history[:2], "grpo", "toy_echo")["warnings"] if "kl_warn" in w]


def test_dis_losses_warn_only_when_the_kept_tokens_moved_too():
    out = io.StringIO()
    guard = KLGuard(0.1, stream=out, kept_threshold=0.02)
    # the demo's step 56: a spike on tokens the DIS band already masks (no gradient) is not warned about
    assert guard.check(56, {"actor/ppo_kl": 0.169, "actor/dis_kept_kl": 0.011, "actor/updated": 1.0}) == \
        {"actor/kl_warning": 0.0}
    assert out.getvalue() == "" and guard.warned_steps == []
    # the lr 1e-3 LiSAO run's step 16: the kept tokens moved too
    assert guard.check(16, {"actor/ppo_kl": 0.107, "actor/dis_kept_kl": 0.023, "actor/updated": 1.0}) == \
        {"actor/kl_warning": 1.0}
    assert "actor/dis_kept_kl 0.0230 on the tokens inside the DIS band > algorithm.kl_warn_kept_threshold 0.02" \
        in out.getvalue()
    # the kept-token KL alone never warns: actor/ppo_kl must be over its threshold first
    assert guard.check(17, {"actor/ppo_kl": 0.05, "actor/dis_kept_kl": 0.5, "actor/updated": 1.0}) == \
        {"actor/kl_warning": 0.0}
    # losses without a DIS band (no actor/dis_kept_kl) are judged on actor/ppo_kl alone
    assert guard.check(18, {"actor/ppo_kl": 0.2, "actor/updated": 1.0}) == {"actor/kl_warning": 1.0}
    assert guard.warned_steps == [16, 18]


def test_a_zero_kept_threshold_warns_on_ppo_kl_alone():
    guard = KLGuard(0.1, stream=io.StringIO(), kept_threshold=0.0)
    assert guard.check(56, {"actor/ppo_kl": 0.169, "actor/dis_kept_kl": 0.011, "actor/updated": 1.0}) == \
        {"actor/kl_warning": 1.0}


def test_kept_threshold_is_validated_and_refused_where_nothing_reports_it():
    assert AlgorithmConfig().kl_warn_kept_threshold == 0.02
    with pytest.raises(ValueError, match="kl_warn_kept_threshold"):
        KLGuard(0.1, kept_threshold=-0.1)
    with pytest.raises(ConfigError, match="algorithm.kl_warn_kept_threshold"):
        AlgorithmConfig(kl_warn_kept_threshold=-1.0).validate()
    with pytest.raises(ConfigError, match="kl_warn_kept_threshold"):  # ppo_clip reports no kept-token KL
        AlgorithmConfig(name="grpo", group_size=4, kl_warn_kept_threshold=0.05).validate()
    AlgorithmConfig(name="lisao", group_size=1, use_critic=True, policy_loss="dis",
                    kl_warn_kept_threshold=0.05).validate()
