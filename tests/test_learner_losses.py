"""Which loss each algorithm's learner step uses (spec §2-§4), with recording stand-ins for the roles."""

import torch

from async_rl.config import AlgorithmConfig, GateConfig
from async_rl.driver.learner import Learner
from async_rl.driver.trajectory import Segment, Trajectory


class RecordingActor:
    def __init__(self):
        self.calls = []

    def update(self, batch, advantages, loss_mode, clip_low, clip_high, dis_low, dis_high, loss_agg_mode):
        self.calls.append({"loss_mode": loss_mode, "loss_agg_mode": loss_agg_mode, "advantages": advantages})
        return {"actor/pg_loss": 0.0}


class RecordingCritic:
    """Values: V = 0.5 everywhere, so explained variances are computable by hand."""

    def __init__(self):
        self.calls = []

    def values(self, batch):
        return torch.full(batch["responses"].shape, 0.5) * batch["response_attention"]

    def update(self, batch, targets, mask, old_values, clip_eps, ranking):
        self.calls.append({"clip_eps": clip_eps, "ranking": ranking, "targets": targets, "mask": mask})
        return {"critic/value_loss": 0.0}


def _traj(i, group, reward, n_tokens=3, group_size=1):
    return Trajectory(uid=f"u{i}", group_id=group, prompt_index=i, prompt_ids=[1, 2],
                      segments=[Segment("model", list(range(3, 3 + n_tokens)), [0.0] * n_tokens, [0] * n_tokens)],
                      reward=reward, success=reward > 0, num_turns=1, group_size=group_size)


def test_lisao_critic_fits_absolute_returns_with_eq5_and_actor_uses_eq1_aggregation():
    cfg = AlgorithmConfig(name="lisao", group_size=1, train_batch_trajectories=2, use_critic=True,
                          policy_loss="dis", critic_updates_per_batch=2)
    actor, critic = RecordingActor(), RecordingCritic()
    learner = Learner(cfg, actor, critic, pad_token_id=0)
    metrics = learner.train_step([_traj(0, "a", 1.0), _traj(1, "b", 0.0)]).metrics
    assert [c["clip_eps"] for c in critic.calls] == [None, None]  # Eq. 5, twice (K = 2)
    assert all(c["ranking"] is None for c in critic.calls)
    assert actor.calls[0]["loss_mode"] == "dis" and actor.calls[0]["loss_agg_mode"] == "seq-mean-token-mean"
    # returns with γ = λ = 1 are R on every model token: [1,1,1] and [0,0,0]; V = 0.5 -> G - V = ±0.5,
    # Var(G) = 0.25, Var(G - V) = 0.25 -> EV = 0 on tokens and at the terminal token alike
    assert metrics["critic/ev_tokens"] == 0.0 and metrics["critic/ev_terminal"] == 0.0
    assert metrics["critic/explained_var"] == metrics["critic/ev_tokens"]


def test_clipping_the_absolute_return_loss_is_an_opt_in_ablation():
    cfg = AlgorithmConfig(name="lisao", group_size=1, train_batch_trajectories=2, use_critic=True,
                          policy_loss="dis", critic_updates_per_batch=1, clip_absolute_value_loss=True)
    critic = RecordingCritic()
    Learner(cfg, RecordingActor(), critic, pad_token_id=0).train_step([_traj(0, "a", 1.0), _traj(1, "b", 0.0)])
    assert critic.calls[0]["clip_eps"] == 0.2


def test_li2sao_bootstrap_keeps_eq10_and_ranking_and_logs_the_gate_every_step():
    cfg = AlgorithmConfig(name="li2sao", group_size=2, train_batch_trajectories=4, use_critic=True,
                          policy_loss="dis_clip", critic_updates_per_batch=1)
    actor, critic = RecordingActor(), RecordingCritic()
    learner = Learner(cfg, actor, critic, pad_token_id=0)
    # group g0 mixed (1, 0), group g1 all-equal (dropped from the critic)
    batch = [_traj(0, "g0", 1.0, group_size=2), _traj(1, "g0", 0.0, group_size=2),
             _traj(2, "g1", 1.0, group_size=2), _traj(3, "g1", 1.0, group_size=2)]
    metrics = learner.train_step(batch).metrics
    assert critic.calls[0]["clip_eps"] == 0.2 and critic.calls[0]["ranking"] is not None
    assert actor.calls[0]["loss_mode"] == "dis_clip"
    for key in ("li2sao/ema_explained_var", "li2sao/ema_rank_acc", "li2sao/gate_counter", "li2sao/eta_e",
                "li2sao/eta_a", "li2sao/mixed_groups_trajectories", "li2sao/explained_var_residual",
                "critic/ev_terminal", "critic/ev_tokens", "critic/ev_loss_mask"):
        assert key in metrics, key
    # Z = R - μ = ±0.5 on the mixed group; V = 0.5 -> Z - V = [0, -1]: Var 0.25 vs Var(Z) 0.25 -> e_k = 0
    assert metrics["li2sao/explained_var_residual"] == 0.0 == metrics["critic/ev_terminal"]
    assert metrics["li2sao/mixed_groups_trajectories"] == 2.0
    assert metrics["li2sao/eta_e"] == 0.2 and metrics["li2sao/eta_a"] == 0.65


def test_grpo_uses_eq1_clip_without_dual_clip():
    cfg = AlgorithmConfig(name="grpo", group_size=2, train_batch_trajectories=2)
    actor = RecordingActor()
    Learner(cfg, actor, None, pad_token_id=0).train_step([_traj(0, "g", 1.0, 1, 2), _traj(1, "g", 0.0, 3, 2)])
    assert actor.calls[0]["loss_mode"] == "ppo_clip"
    assert actor.calls[0]["loss_agg_mode"] == "seq-mean-token-mean"


def test_train_step_reports_publication_and_the_gate_as_fields_not_metrics():
    """The driver acts on StepResult's fields: LiSAO's warm-up step does not update the actor (nothing to
    publish); a Li2SAO step whose gate opens says so once, and the metric for the plots matches it."""
    warm = AlgorithmConfig(name="lisao", group_size=1, train_batch_trajectories=2, use_critic=True,
                           policy_loss="dis", critic_warmup_steps=1)
    learner = Learner(warm, RecordingActor(), RecordingCritic(), pad_token_id=0)
    first = learner.train_step([_traj(0, "a", 1.0), _traj(1, "b", 0.0)])
    second = learner.train_step([_traj(0, "a", 1.0), _traj(1, "b", 0.0)])
    assert (first.actor_updated, second.actor_updated) == (False, True)
    assert (first.metrics["actor/updated"], second.metrics["actor/updated"]) == (0.0, 1.0)
    assert learner.policy_version == 1 and not first.gate_opened and not second.gate_opened

    # no evidence here (e_k = 0): the gate is forced open at T_max
    gated = AlgorithmConfig(name="li2sao", group_size=2, train_batch_trajectories=4, use_critic=True,
                            policy_loss="dis_clip", critic_updates_per_batch=1, gate=GateConfig(t_min=1, t_max=2))
    learner = Learner(gated, RecordingActor(), RecordingCritic(), pad_token_id=0)
    batch = [_traj(0, "g0", 1.0, group_size=2), _traj(1, "g0", 0.0, group_size=2),
             _traj(2, "g1", 1.0, group_size=2), _traj(3, "g1", 0.0, group_size=2)]
    results = [learner.train_step(batch) for _ in range(2)]
    assert [r.gate_opened for r in results] == [False, True]
    assert [r.metrics.get("li2sao/gate_opened") for r in results] == [None, 1.0]


def test_the_learner_takes_its_estimator_from_the_registry_by_plan():
    """Every algorithm's plan names estimators registered in verl; a plan swapped to another registered name
    changes what the actor receives (the Learner looks the name up in verl's registry and calls it with the
    batch as keyword arguments; it does not branch on the algorithm's name)."""
    from verl.trainer.ppo import core_algos

    from async_rl import config as plans
    from async_rl.algos.estimate import AdvantageEstimate

    for name, plan in plans.ALGORITHM_PLANS.items():
        for estimator in (plan.grouped_estimator, plan.single_estimator):
            assert callable(core_algos.get_adv_estimator_fn(estimator)), (name, estimator)

    seen = []

    def constant(token_level_rewards, response_mask, index=None, values=None, config=None, **batch_fields):
        seen.append((list(index), values, sorted(batch_fields)))
        advantages = torch.full(token_level_rewards.shape, 7.0) * response_mask
        return AdvantageEstimate(advantages, advantages)

    core_algos.ADV_ESTIMATOR_REGISTRY["test_constant"] = constant
    original = plans.ALGORITHM_PLANS["grpo"]
    try:
        plans.ALGORITHM_PLANS["grpo"] = plans.AlgorithmPlan("test_constant", "test_constant", needs_groups=True)
        actor = RecordingActor()
        cfg = AlgorithmConfig(name="grpo", group_size=2, train_batch_trajectories=2)
        Learner(cfg, actor, None, pad_token_id=0).train_step([_traj(0, "g", 1.0, 2, 2), _traj(1, "g", 0.0, 2, 2)])
        assert seen == [(["g", "g"], None, ["response_attention", "responses", "scores"])]
        assert float(actor.calls[0]["advantages"].max()) == 7.0
    finally:
        plans.ALGORITHM_PLANS["grpo"] = original
        del core_algos.ADV_ESTIMATOR_REGISTRY["test_constant"]


def test_an_estimator_that_returns_a_plain_tuple_is_refused_by_the_trainer():
    """Stock verl estimators return ``(advantages, returns)``; the trainer also needs the critic's side, so it
    names the problem instead of failing on a missing attribute."""
    import pytest
    from verl.trainer.ppo import core_algos

    from async_rl import config as plans

    core_algos.ADV_ESTIMATOR_REGISTRY["test_plain"] = lambda token_level_rewards, response_mask, **kw: (
        token_level_rewards, token_level_rewards)
    original = plans.ALGORITHM_PLANS["grpo"]
    try:
        plans.ALGORITHM_PLANS["grpo"] = plans.AlgorithmPlan("test_plain", "test_plain", needs_groups=True)
        cfg = AlgorithmConfig(name="grpo", group_size=2, train_batch_trajectories=2)
        with pytest.raises(TypeError, match="AdvantageEstimate"):
            Learner(cfg, RecordingActor(), None, pad_token_id=0).train_step(
                [_traj(0, "g", 1.0, 2, 2), _traj(1, "g", 0.0, 2, 2)])
    finally:
        plans.ALGORITHM_PLANS["grpo"] = original
        del core_algos.ADV_ESTIMATOR_REGISTRY["test_plain"]


def test_li2sao_plan_switches_estimator_and_loss_with_the_phase():
    cfg = AlgorithmConfig(name="li2sao", group_size=2, train_batch_trajectories=2, use_critic=True,
                          policy_loss="dis_clip", critic_updates_per_batch=1)
    actor, critic = RecordingActor(), RecordingCritic()
    learner = Learner(cfg, actor, critic, pad_token_id=0)
    learner.train_step([_traj(0, "g0", 1.0, group_size=2), _traj(1, "g0", 0.0, group_size=2)])
    learner.switch_to_single_rollout()
    learner.train_step([_traj(2, "a", 1.0), _traj(3, "b", 0.0)])
    assert [c["loss_mode"] for c in actor.calls] == ["dis_clip", "dis"]
    # bootstrap: clipped residual loss with ranking; after the switch: plain squared error on absolute returns
    assert [(c["clip_eps"], c["ranking"] is not None) for c in critic.calls] == [(0.2, True), (None, False)]
    assert torch.equal(critic.calls[1]["targets"][0], torch.ones(3))  # G = R = 1 on every model token
