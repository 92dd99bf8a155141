"""Algorithm hyperparameters: each defined once, with its default (the paper's value) and meaning.

``conf/algorithm/_base.yaml`` mirrors these dataclasses field for field and value for value, and each
``conf/algorithm/<name>.yaml`` holds only its differences from it (tests check both), so every value is a Hydra
override: ``algorithm=li2sao algorithm.gate.t_min=30``. Spec sections are cited per field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from async_rl.validation import ConfigError, check_dataclass, dataclass_from_mapping

# No torch here: `python -m async_rl.train` validates the algorithm config before any heavy import, so the
# defaults the loss code also uses are written here, once (async_rl.algos.dis / .policy import them).
DIS_LOW, DIS_HIGH = 0.7, 6.0  # the DIS interval (1-ε_l, 1+ε_h), spec §3
CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # DAPO's asymmetric clip ε_low, ε_high, spec §2
LOSS_AGG_MODES = ("seq-mean-token-mean", "token-mean")  # Eq. 1's mean of per-trajectory token means | ablation


# ----------------------------------------------------------------------------------------------------
# The one algorithm table: which registered estimator and policy loss each algorithm trains with (spec §2-§5).
# The names are entries of verl's registries (get_adv_estimator_fn / get_policy_loss_fn; ours are added by
# async_rl.verl_plugin). The trainer looks a run's plan up by algorithm.name and branches on the plan's fields,
# never on the name; validate() below reads the same fields. A new algorithm is a module with its estimator, its
# registration (the estimator in verl's registry and register_plan here) and a conf/algorithm/<name>.yaml
# (docs/algorithms.md, "Adding an algorithm"). Plain Python: the CLI checks configs before torch loads.
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AlgorithmPlan:
    """What the trainer runs for one algorithm."""

    grouped_estimator: str  # verl estimator name for batches of prompt groups (group_size > 1)
    single_estimator: str  # verl estimator name for batches of one rollout per prompt
    trains_critic: bool = False  # a separate critic model is trained (algorithm.use_critic must say so)
    needs_groups: bool = False  # the estimator compares responses within a prompt group: group_size >= 2
    gated: bool = False  # a readiness gate decides one switch to single rollout (Li2SAO, spec §4)
    bootstrap_loss: Optional[str] = None  # verl policy loss before the switch; None = algorithm.policy_loss
    single_loss: Optional[str] = None  # verl policy loss after it; None = algorithm.policy_loss
    shared_backbone: bool = False  # SAPO: policy, V and Q in one model, trained by its own joint loss (spec §5)
    # what the estimator reads of the config (unread_keys refuses a setting it never reads)
    discounted: bool = True  # reads algorithm.gamma (GRPO's group advantage uses the terminal reward only)
    length_adaptive_lambda: bool = False  # token GAE with λ = 1 - 1/(α·l) (spec §3): reads gae_alpha/gae_lambda
    absolute_value_loss_only: bool = False  # the critic fits Eq. 5 absolute returns only: value_clip needs
    #                                         algorithm.clip_absolute_value_loss (Li2SAO's bootstrap: Eq. 10)


ALGORITHM_PLANS: dict[str, AlgorithmPlan] = {
    "grpo": AlgorithmPlan("grpo_group", "grpo_group", needs_groups=True, discounted=False),
    "lisao": AlgorithmPlan("sao_gae", "sao_gae", trains_critic=True, length_adaptive_lambda=True,
                           absolute_value_loss_only=True),
    "li2sao": AlgorithmPlan("li2sao_group", "sao_gae", trains_critic=True, needs_groups=True, gated=True,
                            bootstrap_loss="dis_clip", single_loss="dis", length_adaptive_lambda=True),
    "ppo": AlgorithmPlan("sao_gae", "sao_gae", trains_critic=True, length_adaptive_lambda=True,
                         absolute_value_loss_only=True),
    "sapo": AlgorithmPlan("sapo_turn", "sapo_turn", shared_backbone=True),
}


def register_plan(name: str, plan: AlgorithmPlan) -> None:
    """Add an algorithm; a name is registered once (re-registering the same plan is a no-op)."""
    existing = ALGORITHM_PLANS.get(name)
    if existing is not None and existing != plan:
        raise ValueError(f"algorithm {name!r} already has a plan ({existing}); choose another name")
    ALGORITHM_PLANS[name] = plan


def plan_for(name: str) -> AlgorithmPlan:
    """The plan of ``algorithm.name``; an unknown name lists the valid ones."""
    if name not in ALGORITHM_PLANS:
        raise ValueError(f"unknown algorithm {name!r}; valid choices: {', '.join(ALGORITHM_PLANS)} (an algorithm of "
                         "your own: algorithm.module=<a module that registers it>, docs/algorithms.md)")
    return ALGORITHM_PLANS[name]


ALGORITHMS = tuple(ALGORITHM_PLANS)  # the built-in algorithms (register_plan adds more at run time)
POLICY_LOSSES = ("ppo_clip", "dis", "dis_clip", "vanilla")  # vanilla: verl's clipped loss with dual clip (ablation)

# Allowed range of every numeric field (dotted names for nested configs), checked by validate() together
# with each field's annotated type. A field not named here gets the range its name implies
# (async_rl.validation.CONVENTION_RANGES: *_lr > 0, *group_size >= 1, gamma/lambda in [0, 1], clip >= 0, ...);
# tests/test_config.py fails for a numeric field that has neither.
ALGORITHM_RANGES = {
    "train_batch_trajectories": ">= 1",  # B
    "clip.clip_ratio_low": "[0, 1)",  # 1 - ε_low must stay positive
    "critic_updates_per_batch": ">= 1",  # K
    "gae_alpha": "> 0",  # λ = 1 - 1/(αL), clamped to [0, 1] (spec §3)
    "dis.low": "(0, 1)",  # 1 - ε_l
    "dis.high": "> 1",  # 1 + ε_h
    "rank_margin": ">= 0",
    "gate.beta": "[0, 1)",
    "gate.eta_e": "<= 1",  # explained variance is at most 1
    "gate.eta_a": "[0, 1]",  # ranking accuracy is a fraction
    "gate.patience": ">= 1",
    "gate.t_min": ">= 0",
    "gate.t_max": ">= 1",
    "sapo_tau_v": "> 0",
    "sapo_r_max": "> 0",
    "sapo_c_v": ">= 0",
    "sapo_c_q": ">= 0",
    "sapo_c_h": ">= 0",
    "sapo_invalid_penalty": ">= 0",
    "kl_warn_threshold": ">= 0",
    "kl_warn_kept_threshold": ">= 0",
}


@dataclass
class ClipConfig:
    clip_ratio_low: float = CLIP_LOW  # ε_low of the clipped objective (DAPO, spec §2: 0.2)
    clip_ratio_high: float = CLIP_HIGH  # ε_high of the clipped objective (DAPO, spec §2: 0.28)


@dataclass
class DISConfig:
    low: float = DIS_LOW  # 1-ε_l: tokens with ratio at or below get zero weight (spec §3: 0.7)
    high: float = DIS_HIGH  # 1+ε_h: tokens with ratio at or above get zero weight (spec §3: 6.0)


@dataclass
class GateConfig:
    beta: float = 0.9  # β, EMA factor of the readiness statistics (spec §4)
    eta_e: float = 0.2  # η_e, residual explained-variance threshold (spec §4)
    eta_a: float = 0.65  # η_a, ranking-accuracy threshold (spec §4)
    patience: int = 10  # M, consecutive ready steps required (spec §4)
    t_min: int = 60  # T_min, bootstrap steps before readiness counts (spec §4; coding: 30)
    t_max: int = 150  # T_max, forced switch step (spec §4; coding: 60)


@dataclass
class AlgorithmConfig:
    name: str = "grpo"  # a registered algorithm (ALGORITHM_PLANS): grpo, lisao, li2sao, ppo, sapo
    module: Optional[str] = None  # a module of yours, imported before the name is looked up: registers its algorithm
    train_batch_trajectories: int = 128  # B, trajectories per optimizer batch (spec §1)
    group_size: int = 8  # n, responses per prompt (GRPO 8, LiSAO 1, Li2SAO bootstrap n_b = 8)
    gamma: float = 1.0  # γ of GAE (spec §3) and of the Li2SAO bootstrap return Ĝ (spec §4); GRPO reads none
    actor_lr: float = 1e-6  # actor learning rate
    entropy_coef: float = 0.0  # entropy bonus: must stay 0 (spec §3: coefficient 0; SAPO's is sapo_c_h)
    grpo_epsilon: float = 1e-6  # ε in the group advantage denominator (spec §2)
    clip: ClipConfig = field(default_factory=ClipConfig)
    overlong_penalty: bool = True  # DAPO soft overlong penalty in the last quarter of the context (spec §2)
    # critic (LiSAO, Li2SAO, PPO)
    use_critic: bool = False  # a separate critic model is trained
    critic_lr: float = 5e-6  # critic learning rate (spec §3)
    critic_updates_per_batch: int = 2  # K critic updates per batch (spec §3)
    critic_warmup_steps: int = 0  # steps with the actor frozen while the critic trains (LiSAO: 10)
    freeze_critic_attention: bool = True  # freeze `self_attn` parameters of the critic (spec §3)
    value_clip: float = 0.2  # ε_v of the clipped residual loss, Eq. 10 (Li2SAO bootstrap, spec §4)
    clip_absolute_value_loss: bool = False  # ablation: clip the absolute-return critic loss too (spec §3 uses Eq. 5, unclipped)
    gae_alpha: float = 1.5  # α of the length-adaptive λ = 1 - 1/(αL) (spec §3)
    gae_lambda: Optional[float] = None  # fixed λ instead of length-adaptive (PPO); None = adaptive
    whiten_advantages: bool = True  # whiten GAE advantages across the data-parallel group (spec §3)
    policy_loss: str = "ppo_clip"  # verl policy-loss name: ppo_clip (Eq. 1), dis, dis_clip, vanilla (ablation: verl's, adds dual clip c=3); Li2SAO uses dis_clip then dis, SAPO its own
    loss_agg_mode: str = "seq-mean-token-mean"  # Eq. 1: mean over trajectories of each one's token mean; token-mean = ablation
    dis: DISConfig = field(default_factory=DISConfig)
    kl_warn_threshold: float = 0.1  # WARNING + actor/kl_warning when actor/ppo_kl, KL(π_{r,v_t} || π_θ) of ρ (spec §3), exceeds this; 0 = off
    kl_warn_kept_threshold: float = 0.02  # dis/dis_clip: warn only if actor/dis_kept_kl (KL on the tokens inside the DIS band) also exceeds this; 0 = actor/ppo_kl alone
    # Li2SAO
    single_group_size: int = 1  # n_s after the switch (spec §4)
    rank_margin: float = 0.1  # m of the terminal ranking loss (spec §4)
    rank_coef: float = 0.1  # α weight of the ranking loss (spec §4)
    gate: GateConfig = field(default_factory=GateConfig)
    # SAPO (spec §5; values the paper does not give are our documented defaults)
    sapo_tau_v: float = 5.0  # τ_v, logit-difference temperature of the readout
    sapo_r_max: float = 1.0  # R_max, value range of the readout
    sapo_lambda: float = 0.95  # λ of turn-level GAE
    sapo_clip_v: float = 0.2  # ε_V of the V loss (normalised space)
    sapo_clip_q: float = 0.2  # ε_Q of the Q loss (normalised space)
    sapo_c_v: float = 0.5  # c_V weight of the V loss
    sapo_c_q: float = 0.5  # c_Q weight of the Q loss
    sapo_c_h: float = 0.0  # c_H entropy weight
    sapo_kl_coef: float = 0.01  # β KL to the reference policy (paper: 0.01)
    sapo_invalid_penalty: float = 0.1  # c_inv invalid-action penalty on turn advantages
    sapo_reserved_tokens: list = field(default_factory=lambda: ["<|value_plus|>", "<|value_minus|>"])  # w+, w-

    def validate(self) -> None:
        """Fail before any worker starts, naming the problem and the valid choices."""
        # every field's type (from its annotation) and range (ALGORITHM_RANGES) first: the checks below
        # compare values and would raise a TypeError on a string such as actor_lr='abc'
        check_dataclass(self, "algorithm", ALGORITHM_RANGES)
        if self.gate.t_max < self.gate.t_min:
            raise ConfigError(f"algorithm.gate.t_max={self.gate.t_max}: must be >= algorithm.gate.t_min={self.gate.t_min}")
        if len(self.sapo_reserved_tokens) != 2 or len(set(self.sapo_reserved_tokens)) != 2 or \
                not all(isinstance(t, str) and t for t in self.sapo_reserved_tokens):
            raise ConfigError(f"algorithm.sapo_reserved_tokens={self.sapo_reserved_tokens}: must be two distinct "
                              "non-empty token strings (w+, w-)")
        plan = plan_for(self.name)  # an unknown name lists the valid ones
        if self.group_size < 1 or self.train_batch_trajectories < 1:
            raise ValueError("group_size and train_batch_trajectories must be >= 1")
        if self.train_batch_trajectories % self.group_size:
            raise ValueError(
                f"train_batch_trajectories (B={self.train_batch_trajectories}) must be divisible by "
                f"group_size (n={self.group_size}): a batch holds whole prompt groups"
            )
        if plan.needs_groups and self.group_size < 2:
            raise ValueError(f"{self.name} needs group_size >= 2 (paper: 8)")
        if plan.trains_critic and not self.use_critic:
            raise ValueError(f"{self.name} trains a critic: set use_critic=true")
        if not (0 < self.dis.low < 1 < self.dis.high):
            raise ValueError(f"DIS interval must contain 1, got ({self.dis.low}, {self.dis.high})")
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"algorithm.policy_loss={self.policy_loss!r}; valid choices: {', '.join(POLICY_LOSSES)}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"algorithm.loss_agg_mode={self.loss_agg_mode!r}; valid choices: "
                             f"{', '.join(LOSS_AGG_MODES)}")
        if not plan.trains_critic and self.use_critic:
            raise ConfigError(f"algorithm.use_critic=true: {self.name} trains no separate critic; set "
                              "algorithm.use_critic=false")
        for key, (allowed, why) in unread_keys(self).items():
            value = _dotted(self, key)
            if value != allowed:
                raise ConfigError(f"algorithm.{key}={value!r} is not read by algorithm={self.name} ({why}); "
                                  f"allowed: {allowed!r}")


def _dotted(obj: Any, key: str) -> Any:
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def unread_keys(cfg: "AlgorithmConfig") -> dict[str, tuple[Any, str]]:
    """``{dotted key: (the one allowed value, why)}`` for every field that ``cfg.name`` (with its policy loss)
    never reads although it names a part of that algorithm's computation: :meth:`AlgorithmConfig.validate`
    refuses any other value there, so no such key is accepted and then ignored. The allowed value is the
    field's default unless named here. Settings of *another* algorithm's parts (``gate.*``/``rank_*`` outside
    li2sao, ``sapo_*`` outside sapo, critic keys without a critic, ``grpo_epsilon`` without a group advantage)
    are not refused: a recipe sets them once for every ``algorithm=`` it may be launched with (conf/demo.yaml's
    gate, recipes/retool_tiny.yaml's critic warm-up), and no reader of this algorithm can be mistaken for them."""
    default = AlgorithmConfig()
    out: dict[str, tuple[Any, str]] = {}
    plan = plan_for(cfg.name)

    def unread(keys, why, allowed=None):
        for key in keys:
            out[key] = (_dotted(default, key) if allowed is None else allowed, why)

    unread(["entropy_coef"], "no entropy bonus: spec §3 sets the coefficient to 0"
           + ("; SAPO's entropy weight is algorithm.sapo_c_h" if plan.shared_backbone else ""))
    if not plan.discounted:
        unread(["gamma"], f"{cfg.name}'s advantage uses the terminal reward only")
    # the policy losses the run uses: the plan's own (before/after a switch), else algorithm.policy_loss
    losses = {plan.bootstrap_loss or cfg.policy_loss, plan.single_loss or cfg.policy_loss}
    # policy_loss is never read only where the plan fixes the loss of both phases (Li2SAO); one fixed phase leaves
    # algorithm.policy_loss to the other
    fixed_losses = plan.bootstrap_loss is not None and plan.single_loss is not None
    dis_losses = {"dis", "dis_clip"}
    if plan.shared_backbone:
        why = "SAPO's loss is its own: token-level PPO clip with ε = algorithm.clip.clip_ratio_low, turn means"
        unread(["policy_loss", "loss_agg_mode", "clip.clip_ratio_high", "dis.low", "dis.high"], why)
    elif fixed_losses:
        unread(["policy_loss"], f"{cfg.name} uses {plan.bootstrap_loss} before its switch and {plan.single_loss} "
               "after it (spec §4)", allowed=plan.bootstrap_loss)
    elif not losses & dis_losses:
        unread(["dis.low", "dis.high"], f"policy_loss={cfg.policy_loss} has no DIS mask")
    if plan.shared_backbone or not losses & dis_losses:
        unread(["kl_warn_kept_threshold"], "only the DIS losses (dis, dis_clip) report actor/dis_kept_kl")
    elif losses == {"dis"}:
        unread(["clip.clip_ratio_low", "clip.clip_ratio_high"], "policy_loss=dis has no ratio clip (spec §3)")
    if plan.absolute_value_loss_only and not cfg.clip_absolute_value_loss:
        unread(["value_clip"], "Eq. 5's absolute-return loss is unclipped; set clip_absolute_value_loss=true")
    if cfg.gae_lambda is not None and plan.length_adaptive_lambda:
        unread(["gae_alpha"], "a fixed algorithm.gae_lambda replaces the length-adaptive λ")
    return out


def algorithm_config_from_dict(data: dict[str, Any]) -> AlgorithmConfig:
    """Build an :class:`AlgorithmConfig` from a plain dict (e.g. a resolved Hydra node); unknown keys, wrong
    types and out-of-range values fail with :class:`~async_rl.validation.ConfigError`."""
    cfg = dataclass_from_mapping(AlgorithmConfig, dict(data), "algorithm")
    cfg.validate()
    return cfg
