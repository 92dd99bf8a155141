"""Every algorithm key does what it says or is refused (issue: keys validated but never read).

For each algorithm: every key in :func:`async_rl.config.unread_keys` set to another value fails validation
with one line naming the key; every key the learner step reads, set to another value, changes what the
step hands to the actor or critic (recording stand-ins, as in tests/test_learner_losses.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from async_rl.config import POLICY_LOSSES, AlgorithmConfig, GateConfig, unread_keys
from async_rl.driver.learner import Learner
from async_rl.driver.trajectory import Segment, Trajectory
from async_rl.validation import ConfigError

BASE = {
    "grpo": dict(group_size=2, train_batch_trajectories=4),
    "lisao": dict(group_size=1, train_batch_trajectories=4, use_critic=True, policy_loss="dis"),
    "li2sao": dict(group_size=2, train_batch_trajectories=4, use_critic=True, policy_loss="dis_clip",
                   gate=GateConfig(t_min=0, patience=3, t_max=5)),
    "ppo": dict(group_size=1, train_batch_trajectories=4, use_critic=True, gae_lambda=0.95),
    "sapo": dict(group_size=1, train_batch_trajectories=4),
}


def dotted_fields(obj, prefix=""):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from dotted_fields(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


def other_value(key: str, value):
    """A valid value different from ``value`` (in range, so the only possible refusal is 'not read')."""
    if key == "policy_loss":
        return next(p for p in POLICY_LOSSES if p != value)
    if key == "loss_agg_mode":
        return "token-mean" if value != "token-mean" else "seq-mean-token-mean"
    if key == "sapo_reserved_tokens":
        return ["<a>", "<b>"]
    if isinstance(value, bool):
        return not value
    if value is None:
        return 0.9
    if isinstance(value, int):
        return value + 1
    return 0.5 if value == 0 else value * 0.5


def with_key(cfg: AlgorithmConfig, key: str, value) -> AlgorithmConfig:
    if "." in key:
        outer, inner = key.split(".")
        return dataclasses.replace(cfg, **{outer: dataclasses.replace(getattr(cfg, outer), **{inner: value})})
    return dataclasses.replace(cfg, **{key: value})


@pytest.mark.parametrize("name", list(BASE))
def test_every_key_an_algorithm_does_not_read_is_refused_with_one_line(name):
    cfg = AlgorithmConfig(name=name, **BASE[name])
    cfg.validate()
    unread = unread_keys(cfg)
    assert "entropy_coef" in unread
    for key, (allowed, _) in unread.items():
        changed = with_key(cfg, key, other_value(key, allowed))
        with pytest.raises(ConfigError) as err:
            changed.validate()
        message = str(err.value)
        assert message.startswith(f"algorithm.{key}=") and "is not read by algorithm=" + name in message, message
        assert "allowed: " in message and "\n" not in message


def test_the_issue_keys_are_refused_where_nothing_reads_them():
    refused = {("grpo", "entropy_coef"), ("lisao", "entropy_coef"), ("li2sao", "entropy_coef"),
               ("sapo", "entropy_coef"), ("li2sao", "policy_loss"), ("sapo", "policy_loss"),
               ("sapo", "loss_agg_mode"), ("sapo", "clip.clip_ratio_high"), ("grpo", "gamma"),
               ("lisao", "clip.clip_ratio_high"), ("grpo", "dis.high"), ("ppo", "value_clip"),
               ("ppo", "gae_alpha")}
    for name, key in refused:
        assert key in unread_keys(AlgorithmConfig(name=name, **BASE[name])), (name, key)
    # read, so not refused: li2sao's γ (its bootstrap return), lisao's DIS interval, grpo's clip
    for name, key in [("li2sao", "gamma"), ("lisao", "dis.low"), ("grpo", "clip.clip_ratio_high"),
                      ("ppo", "clip.clip_ratio_high"), ("sapo", "clip.clip_ratio_low")]:
        assert key not in unread_keys(AlgorithmConfig(name=name, **BASE[name])), (name, key)
    with pytest.raises(ConfigError, match="algorithm.use_critic=true: grpo trains no separate critic"):
        AlgorithmConfig(name="grpo", use_critic=True, **BASE["grpo"]).validate()


def test_another_algorithms_settings_stay_allowed_for_shared_recipes():
    """conf/demo.yaml sets Li2SAO's gate and recipes/retool_tiny.yaml a critic warm-up for whichever
    algorithm= they are launched with (the issue's own repro: --config-name demo algorithm=lisao)."""
    for name in BASE:
        AlgorithmConfig(name=name, **{**BASE[name], "gate": GateConfig(t_min=20, patience=5, t_max=90),
                                      "rank_coef": 0.2, "sapo_c_h": 0.01, "critic_warmup_steps": 1,
                                      "grpo_epsilon": 1e-4}).validate()


# ------------------------------------------------------------------------------------------- read keys
class RecordingActor:
    def __init__(self):
        self.calls = []

    def update(self, batch, advantages, loss_mode, clip_low, clip_high, dis_low, dis_high, loss_agg_mode):
        self.calls.append([advantages, loss_mode, clip_low, clip_high, dis_low, dis_high, loss_agg_mode])
        return {}


class RecordingCritic:
    """V grows along the response so that γ, λ and whitening all move the GAE advantages."""

    def __init__(self):
        self.calls = []

    def values(self, batch):
        T = batch["responses"].shape[1]
        return torch.linspace(0.1, 0.6, T).expand(batch["responses"].shape) * batch["response_attention"]

    def update(self, batch, targets, mask, old_values, clip_eps, ranking):
        self.calls.append([targets, mask, clip_eps, None if ranking is None else (ranking["margin"], ranking["coef"])])
        return {}


def _batch(grouped: bool) -> list[Trajectory]:
    rewards = [1.0, 0.0, 0.0, 1.0]
    n_tokens = [3, 5, 2, 4]
    return [Trajectory(uid=f"u{i}", group_id=f"g{i // 2}" if grouped else f"g{i}", prompt_index=i, prompt_ids=[1, 2],
                       segments=[Segment("model", list(range(3, 3 + n)), [0.0] * n, [0] * n)],
                       reward=r, success=r > 0, num_turns=1, group_size=2 if grouped else 1)
            for i, (r, n) in enumerate(zip(rewards, n_tokens))]


def record(cfg: AlgorithmConfig, steps: int = 1):
    actor, critic = RecordingActor(), (RecordingCritic() if cfg.use_critic else None)
    learner = Learner(cfg, actor, critic, pad_token_id=0)
    for _ in range(steps):
        learner.train_step(_batch(grouped=cfg.group_size > 1))
    return actor.calls, (critic.calls if critic else [])


def same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# the keys each learner step reads (the others are read by the driver, the builder or the SAPO role, or
# are refused above); critic_warmup_steps is checked with 1 -> 2 over two steps
LEARNER_KEYS = {
    "grpo": ["grpo_epsilon", "clip.clip_ratio_low", "clip.clip_ratio_high", "policy_loss", "loss_agg_mode"],
    "lisao": ["gamma", "dis.low", "dis.high", "policy_loss", "loss_agg_mode", "critic_updates_per_batch",
              "clip_absolute_value_loss", "gae_alpha", "gae_lambda", "whiten_advantages"],
    "li2sao": ["gamma", "grpo_epsilon", "clip.clip_ratio_low", "clip.clip_ratio_high", "dis.low", "dis.high",
               "loss_agg_mode", "critic_updates_per_batch", "value_clip", "rank_margin", "rank_coef"],
    "ppo": ["gamma", "clip.clip_ratio_low", "clip.clip_ratio_high", "policy_loss", "loss_agg_mode",
            "critic_updates_per_batch", "clip_absolute_value_loss", "gae_lambda", "whiten_advantages"],
}


@pytest.mark.parametrize("name", list(LEARNER_KEYS))
def test_every_key_the_learner_reads_changes_what_it_computes(name):
    cfg = AlgorithmConfig(name=name, **BASE[name])
    base = record(cfg)
    for key in LEARNER_KEYS[name]:
        value = dict(dotted_fields(cfg))[key]
        new = other_value(key, value)
        if key == "grpo_epsilon":
            new = 0.5  # 1e-6 * 0.5 moves the advantage by less than float32 resolution
        if key == "policy_loss" and name == "ppo":
            new = "dis_clip"
        changed = with_key(cfg, key, new)
        changed.validate()
        assert not same(record(changed), base), f"{name}: algorithm.{key}={new!r} changed nothing"
    if name != "grpo":
        one, two = (record(with_key(cfg, "critic_warmup_steps", k), steps=2) for k in (1, 2))
        assert len(one[0]) == 1 and len(two[0]) == 0  # actor frozen for the first k steps


def test_li2sao_bootstrap_gamma_discounts_the_critic_target_by_hand():
    """Ĝ_t = γ^k R with k = model tokens after t; μ_g = 0.5 is subtracted (residual target, Eq. 10)."""
    cfg = AlgorithmConfig(name="li2sao", **{**BASE["li2sao"], "gamma": 0.5, "critic_updates_per_batch": 1})
    _, critic_calls = record(cfg)
    targets = critic_calls[0][0]
    # trajectory 0: R = 1, 3 model tokens -> Ĝ = [0.25, 0.5, 1]; minus μ = 0.5
    torch.testing.assert_close(targets[0, :3], torch.tensor([-0.25, 0.0, 0.5]))
    # trajectory 1: R = 0, 5 tokens -> Ĝ = 0; target -0.5 on every model token
    torch.testing.assert_close(targets[1, :5], torch.full((5,), -0.5))


def test_li2sao_gate_keys_reach_the_gate():
    gate = GateConfig(beta=0.5, eta_e=0.1, eta_a=0.6, patience=4, t_min=2, t_max=9)
    learner = Learner(AlgorithmConfig(name="li2sao", **{**BASE["li2sao"], "gate": gate}), RecordingActor(),
                      RecordingCritic(), pad_token_id=0)
    assert {k: getattr(learner.gate, k) for k in vars(gate)} == vars(gate)


def test_a_plan_that_fixes_one_phases_loss_still_reads_policy_loss_for_the_other(monkeypatch):
    """unread_keys follows the plan's fields: policy_loss is refused only where both phases' losses are fixed."""
    from async_rl import config

    monkeypatch.setitem(config.ALGORITHM_PLANS, "half_fixed",
                        config.AlgorithmPlan("sao_gae", "sao_gae", trains_critic=True, bootstrap_loss="dis_clip"))
    unread = unread_keys(AlgorithmConfig(name="half_fixed", policy_loss="ppo_clip"))
    assert "policy_loss" not in unread
    # the losses in use are dis_clip (fixed) and ppo_clip (read): the DIS keys are read, the clip keys too
    assert not {"dis.low", "dis.high", "kl_warn_kept_threshold", "clip.clip_ratio_low"} & set(unread)
    assert unread_keys(AlgorithmConfig(name="li2sao", policy_loss="dis_clip"))["policy_loss"][0] == "dis_clip"
