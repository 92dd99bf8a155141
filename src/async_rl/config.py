"""Algorithm hyperparameters: each defined once, with its default (the paper's value) and meaning.

``conf/algorithm/_base.yaml`` mirrors these dataclasses field for field and value for value, and each
``conf/algorithm/<name>.yaml`` holds only its differences from it (tests check both), so every value is a Hydra
override: ``algorithm=li2sao algorithm.gate.t_min=30``. Spec sections are cited per field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from async_rl.validation import ConfigError, check_settings, setting, settings_from_mapping

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

# Every field below is a setting(): its type, default, allowed range or choices and one-line meaning in one place.
# async_rl.validation.check_settings derives every single-value check from them; validate() adds the checks that
# compare fields or read the plan table.
@dataclass
class ClipConfig:
    clip_ratio_low: float = setting(CLIP_LOW, "ε_low of the clipped objective (DAPO, spec §2: 0.2)",
                                    range="[0, 1)")  # 1 - ε_low must stay positive
    clip_ratio_high: float = setting(CLIP_HIGH, "ε_high of the clipped objective (DAPO, spec §2: 0.28)", range=">= 0")


@dataclass
class DISConfig:
    low: float = setting(DIS_LOW, "1-ε_l: tokens with ratio at or below get zero weight (spec §3: 0.7)",
                         range="(0, 1)")
    high: float = setting(DIS_HIGH, "1+ε_h: tokens with ratio at or above get zero weight (spec §3: 6.0)",
                          range="> 1")


@dataclass
class GateConfig:
    beta: float = setting(0.9, "β, EMA factor of the readiness statistics (spec §4)", range="[0, 1)")
    eta_e: float = setting(0.2, "η_e, residual explained-variance threshold (spec §4)", range="<= 1")
    eta_a: float = setting(0.65, "η_a, ranking-accuracy threshold (spec §4)", range="[0, 1]")
    patience: int = setting(10, "M, consecutive ready steps required (spec §4)", range=">= 1")
    t_min: int = setting(60, "T_min, bootstrap steps before readiness counts (spec §4; coding: 30)", range=">= 0")
    t_max: int = setting(150, "T_max, forced switch step (spec §4; coding: 60)", range=">= 1")


@dataclass
class AlgorithmConfig:
    name: str = setting("grpo", "a registered algorithm (ALGORITHM_PLANS): grpo, lisao, li2sao, ppo, sapo",
                        non_empty=True)
    module: Optional[str] = setting(None, "a module of yours, imported before the name is looked up: registers its "
                                          "algorithm", non_empty=True)
    train_batch_trajectories: int = setting(128, "B, trajectories per optimizer batch (spec §1)", range=">= 1")
    group_size: int = setting(8, "n, responses per prompt (GRPO 8, LiSAO 1, Li2SAO bootstrap n_b = 8)", range=">= 1")
    gamma: float = setting(1.0, "γ of GAE (spec §3) and of the Li2SAO bootstrap return Ĝ (spec §4); GRPO reads none",
                           range="[0, 1]")
    actor_lr: float = setting(1e-6, "actor learning rate", range="> 0")
    entropy_coef: float = setting(0.0, "entropy bonus: must stay 0 (spec §3: coefficient 0; SAPO's is sapo_c_h)",
                                  range=">= 0")
    grpo_epsilon: float = setting(1e-6, "ε in the group advantage denominator (spec §2)", range="> 0")
    clip: ClipConfig = setting(ClipConfig(), "the clipped objective's ε_low, ε_high (spec §2)")
    overlong_penalty: bool = setting(True, "DAPO soft overlong penalty in the last quarter of the context (spec §2)")
    # critic (LiSAO, Li2SAO, PPO)
    use_critic: bool = setting(False, "a separate critic model is trained")
    critic_lr: float = setting(5e-6, "critic learning rate (spec §3)", range="> 0")
    critic_updates_per_batch: int = setting(2, "K critic updates per batch (spec §3)", range=">= 1")
    critic_warmup_steps: int = setting(0, "steps with the actor frozen while the critic trains (LiSAO: 10)",
                                       range=">= 0")
    freeze_critic_attention: bool = setting(True, "freeze `self_attn` parameters of the critic (spec §3)")
    value_clip: float = setting(0.2, "ε_v of the clipped residual loss, Eq. 10 (Li2SAO bootstrap, spec §4)",
                                range=">= 0")
    clip_absolute_value_loss: bool = setting(False, "ablation: clip the absolute-return critic loss too (spec §3 "
                                                    "uses Eq. 5, unclipped)")
    gae_alpha: float = setting(1.5, "α of the length-adaptive λ = 1 - 1/(αL), clamped to [0, 1] (spec §3)",
                               range="> 0")
    gae_lambda: Optional[float] = setting(None, "fixed λ instead of length-adaptive (PPO); null = adaptive",
                                          range="[0, 1]")
    whiten_advantages: bool = setting(True, "whiten GAE advantages across the data-parallel group (spec §3)")
    policy_loss: str = setting("ppo_clip", "verl policy-loss name: ppo_clip (Eq. 1), dis, dis_clip, vanilla "
                                           "(ablation: verl's, adds dual clip c=3); Li2SAO uses dis_clip then dis, "
                                           "SAPO its own", choices=POLICY_LOSSES)
    loss_agg_mode: str = setting("seq-mean-token-mean", "Eq. 1: mean over trajectories of each one's token mean; "
                                                        "token-mean = ablation", choices=LOSS_AGG_MODES)
    dis: DISConfig = setting(DISConfig(), "the DIS interval (spec §3)")
    kl_warn_threshold: float = setting(0.1, "WARNING + actor/kl_warning when actor/ppo_kl, KL(π_{r,v_t} || π_θ) of "
                                            "ρ (spec §3), exceeds this; 0 = off", range=">= 0")
    kl_warn_kept_threshold: float = setting(0.02, "dis/dis_clip: warn only if actor/dis_kept_kl (KL on the tokens "
                                                  "inside the DIS band) also exceeds this; 0 = actor/ppo_kl alone",
                                            range=">= 0")
    # Li2SAO
    single_group_size: int = setting(1, "n_s after the switch (spec §4)", range=">= 1")
    rank_margin: float = setting(0.1, "m of the terminal ranking loss (spec §4)", range=">= 0")
    rank_coef: float = setting(0.1, "α weight of the ranking loss (spec §4)", range=">= 0")
    gate: GateConfig = setting(GateConfig(), "Li2SAO's readiness gate (spec §4)")
    # SAPO (spec §5; values the paper does not give are our documented defaults)
    sapo_tau_v: float = setting(5.0, "τ_v, logit-difference temperature of the readout", range="> 0")
    sapo_r_max: float = setting(1.0, "R_max, value range of the readout", range="> 0")
    sapo_lambda: float = setting(0.95, "λ of turn-level GAE", range="[0, 1]")
    sapo_clip_v: float = setting(0.2, "ε_V of the V loss (normalised space)", range=">= 0")
    sapo_clip_q: float = setting(0.2, "ε_Q of the Q loss (normalised space)", range=">= 0")
    sapo_c_v: float = setting(0.5, "c_V weight of the V loss", range=">= 0")
    sapo_c_q: float = setting(0.5, "c_Q weight of the Q loss", range=">= 0")
    sapo_c_h: float = setting(0.0, "c_H entropy weight", range=">= 0")
    sapo_kl_coef: float = setting(0.01, "β KL to the reference policy (paper: 0.01)", range=">= 0")
    sapo_invalid_penalty: float = setting(0.1, "c_inv invalid-action penalty on turn advantages", range=">= 0")
    sapo_reserved_tokens: list[str] = setting(["<|value_plus|>", "<|value_minus|>"],
                                              "w+, w-: the two reserved value-readout tokens (docs/sapo.md)",
                                              non_empty=True)

    def validate(self) -> None:
        """Fail before any worker starts, naming the problem and the valid choices."""
        # every field's type, range and choices (its setting()) first: the checks below compare values and
        # would raise a TypeError on a string such as actor_lr='abc'
        check_settings(self, "algorithm")
        if self.gate.t_max < self.gate.t_min:
            raise ConfigError(f"algorithm.gate.t_max={self.gate.t_max}: must be >= algorithm.gate.t_min={self.gate.t_min}")
        if len(self.sapo_reserved_tokens) != 2 or len(set(self.sapo_reserved_tokens)) != 2 or \
                not all(isinstance(t, str) and t for t in self.sapo_reserved_tokens):
            raise ConfigError(f"algorithm.sapo_reserved_tokens={self.sapo_reserved_tokens}: must be two distinct "
                              "non-empty token strings (w+, w-)")
        plan = plan_for(self.name)  # an unknown name lists the valid ones
        if self.train_batch_trajectories % self.group_size:
            raise ValueError(
                f"train_batch_trajectories (B={self.train_batch_trajectories}) must be divisible by "
                f"group_size (n={self.group_size}): a batch holds whole prompt groups"
            )
        if plan.needs_groups and self.group_size < 2:
            raise ValueError(f"{self.name} needs group_size >= 2 (paper: 8)")
        if plan.trains_critic and not self.use_critic:
            raise ValueError(f"{self.name} trains a critic: set use_critic=true")
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
    cfg = settings_from_mapping(AlgorithmConfig, dict(data), "algorithm")
    cfg.validate()
    return cfg
