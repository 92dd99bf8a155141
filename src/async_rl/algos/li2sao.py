"""Li2SAO: group bootstrap of actor and critic, readiness gate, one-way switch (spec §4; paper §4, App. F).

Everything here is a pure tensor function except :class:`ReadinessGate`, a tiny serialisable state
machine. Shapes: ``bs`` responses, ``T`` response positions (model and observation tokens).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from async_rl.algos._util import group_index, last_true_index, loss_denominator, masked_mean
from async_rl.algos.estimate import AdvantageEstimate, config_value
from async_rl.algos.gae import sao_gae
from async_rl.algos.grpo import broadcast_to_tokens, group_statistics, grpo_group_advantage
from async_rl.algos.metrics import critic_explained_variance


# ----------------------------------------------------------------------------------------------------
# actor: group advantage during bootstrap, GAE after the switch (spec §4, App. F.3)
# ----------------------------------------------------------------------------------------------------
def li2sao_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids,
    values: Optional[torch.Tensor] = None,
    complete_group: Optional[torch.Tensor] = None,
    epsilon: float = 1e-6,
    alpha: float = 1.5,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Li2SAO actor advantage and critic return for one batch.

    The group advantage (GRPO, spec §2) overwrites the GAE advantage only when the largest prompt group
    in the batch has more than one response (App. F.3); otherwise (after the switch) single-rollout
    skip-observation GAE is used (spec §3). A response whose group is not complete in this partition
    (``complete_group[i] == False``) keeps the GAE estimate.

    Args:
        token_level_rewards: ``(bs, T)``, outcome reward on the last model token.
        response_mask: ``(bs, T)``.
        group_ids: ``(bs,)``.
        values: ``(bs, T)`` critic values; required for GAE (after the switch or for incomplete groups).
        complete_group: optional ``(bs,)`` bool.

    Returns:
        ``(advantages, returns)`` ``(bs, T)``. ``returns`` are absolute λ=1 returns ``γ^k R`` (``= R`` on
        model tokens for γ = 1); bootstrap critics use :func:`residual_critic_targets` on them.
    """
    scores = token_level_rewards.sum(dim=-1)
    _, _, size = group_statistics(scores, group_ids)
    use_group = bool((size > 1).any())
    need_gae = (not use_group) or (complete_group is not None and not bool(complete_group.all()))
    if need_gae:
        if values is None:
            raise ValueError(
                "li2sao_advantage needs critic `values` for single-rollout GAE (after the switch, or for "
                "groups split across partitions); pass values=(bs, T) critic outputs"
            )
        gae_adv, returns = sao_gae(token_level_rewards, values, response_mask, alpha=alpha, gamma=gamma)
    else:
        # the λ = 1 return, γ^k R (R on every model token at the spec's γ = 1, paper Eq. 36), as the GAE branch
        # computes it: the critic target must not depend on whether some group was incomplete
        returns = bootstrap_returns(scores, response_mask, gamma)
        gae_adv = torch.zeros_like(returns)
    if not use_group:
        return gae_adv, returns
    group_adv = broadcast_to_tokens(grpo_group_advantage(scores, group_ids, epsilon), response_mask)
    if complete_group is None:
        return group_adv, returns
    keep_group = complete_group.to(torch.bool).unsqueeze(-1)
    return torch.where(keep_group, group_adv, gae_adv), returns


# ----------------------------------------------------------------------------------------------------
# critic targets and masks (spec §4)
# ----------------------------------------------------------------------------------------------------
def bootstrap_returns(scores: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """The bootstrap's λ = 1 return ``Ĝ_{i,t} = γ^{k_t} R_i`` on model tokens (spec §4, with §3's skip-observation
    discount): ``k_t`` = the number of model tokens after position t (observation tokens are not discounted,
    as in Eq. 6), the outcome reward R arriving at the last model token. ``γ = 1`` (the spec) gives ``R``
    on every model token. Shapes: scores ``(bs,)``, mask and result ``(bs, T)``."""
    mask = response_mask.to(torch.float32)
    after = torch.flip(torch.cumsum(torch.flip(mask, dims=[1]), dim=1), dims=[1]) - mask
    return scores.to(torch.float32).unsqueeze(-1) * torch.pow(torch.tensor(float(gamma)), after) * mask


def residual_critic_targets(
    returns: torch.Tensor, scores: torch.Tensor, group_ids, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``G̃_{i,t} = Ĝ_{i,t} - μ_g``; groups whose rewards are all equal are dropped.

    Compute on the whole batch (the driver) so ``μ_g`` uses every member of the group.

    Args:
        returns: ``(bs, T)`` λ=1 returns Ĝ.
        scores: ``(bs,)`` outcome rewards R.
        group_ids: ``(bs,)``.
        response_mask: ``(bs, T)``.

    Returns:
        ``(targets (bs, T), keep (bs,) bool)``; ``keep`` is False for all-equal (incl. singleton) groups.
    """
    mean, std, _ = group_statistics(scores, group_ids)
    targets = (returns.to(torch.float32) - mean.unsqueeze(-1)) * response_mask.to(torch.float32)
    return targets, std > 0


def _group_table(dense: torch.Tensor) -> torch.Tensor:
    """``(G, n_max)`` table of sample indices per dense group id, padded with -1."""
    bs = dense.numel()
    order = torch.argsort(dense, stable=True)
    counts = torch.bincount(dense)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(bs, device=dense.device) - starts[dense[order]]
    table = torch.full((counts.numel(), int(counts.max())), -1, dtype=torch.long, device=dense.device)
    table[dense[order], rank] = order
    return table


def divergence_mask(
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    scores: torch.Tensor,
    group_ids,
    valid_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Li2SAO critic mask ``c_{i,t}`` (spec §4).

    ``d(i, j)`` is the first response position where responses ``i`` and ``j`` differ (a shorter response
    differs from a longer one where it ends); ``d_i = max_{j in g, R_j != R_i} d(i, j)``; the mask is 1 on
    model tokens at and after ``d_i``. When this partition holds no response of ``i``'s group with a
    different reward -- or ``i`` equals every opposite-outcome response token for token -- only the last
    model ("action") token is kept.

    Args:
        response_ids: ``(bs, T)`` token ids of the response (model and observation tokens).
        response_mask: ``(bs, T)``, 1 on model tokens.
        scores: ``(bs,)`` outcome rewards.
        group_ids: ``(bs,)``.
        valid_mask: ``(bs, T)``, 1 on real (non-padding) response positions; default: every position up
            to the last model token.

    Returns:
        ``(bs, T)`` float mask.
    """
    bs, T = response_ids.shape
    device = response_ids.device
    if bs == 0 or T == 0:  # nothing to compare
        return torch.zeros(bs, T, device=device)
    positions = torch.arange(T, device=device).unsqueeze(0)
    last_model = last_true_index(response_mask)
    if valid_mask is None:
        valid_mask = positions <= last_model.unsqueeze(1)
    # padding compares unequal to any real token
    tokens = torch.where(valid_mask.bool(), response_ids, torch.full_like(response_ids, -1))
    dense = group_index(group_ids, device=device)
    table = _group_table(dense)  # (G, n)
    present = table >= 0
    idx = table.clamp_min(0)
    tok = tokens[idx]  # (G, n, T)
    differs = tok.unsqueeze(2) != tok.unsqueeze(1)  # (G, n, n, T)
    first_diff = torch.where(differs.any(-1), differs.to(torch.int8).argmax(-1), T)  # d(i, j), (G, n, n)
    s = scores.to(torch.float32)[idx]
    opposite = (s.unsqueeze(2) != s.unsqueeze(1)) & present.unsqueeze(2) & present.unsqueeze(1)
    d_group = torch.where(opposite, first_diff, torch.full_like(first_diff, -1)).amax(-1)  # (G, n)
    d = torch.full((bs,), -1, dtype=torch.long, device=device)
    d[table[present]] = d_group[present]

    mask = response_mask.bool() & (positions >= d.unsqueeze(1))
    # fallback: no opposite outcome here, or identical to every opposite response
    fallback = (d < 0) | ~mask.any(-1)
    last_only = positions == last_model.unsqueeze(1)
    mask = torch.where(fallback.unsqueeze(1), last_only & response_mask.bool(), mask)
    return mask.to(torch.float32)


def values_at_last_model_token(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``V(s_{i,T_i})``: the value read at each response's last model token; ``(bs, T) -> (bs,)``."""
    last = last_true_index(response_mask).clamp_min(0)
    return values.gather(1, last.unsqueeze(1)).squeeze(1)


# ----------------------------------------------------------------------------------------------------
# critic losses (spec §4, Eq. 10-11)
# ----------------------------------------------------------------------------------------------------
def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    loss_normaliser: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``Σ c · max((V - G)², (V̄ - G)²) / Σ c`` with ``V̄ = V_old + clip(V - V_old, -ε_v, ε_v)`` (Eq. 10).

    Used with residual targets and the divergence mask during Li2SAO's bootstrap, and with absolute
    returns and the response mask for LiSAO / PPO / after the switch (Eq. 5).

    Args:
        values: ``(bs, T)`` current critic values (with grad).
        old_values: ``(bs, T)`` values frozen once per batch before the critic passes.
        targets: ``(bs, T)``.
        mask: ``(bs, T)`` critic mask ``c``.
        clip_eps: ε_v (spec: 0.2).
        loss_normaliser: replaces ``Σ c`` (e.g. the global count for data parallelism).

    Returns:
        ``(loss, metrics)`` with ``critic/vf_clipfrac``.
    """
    m = mask.to(values.dtype)
    old_values = old_values.detach()
    clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    err = (values - targets) ** 2
    err_clipped = (clipped - targets) ** 2
    loss = (torch.maximum(err, err_clipped) * m).sum() / loss_denominator(m.sum(), loss_normaliser)
    clipfrac = masked_mean((err_clipped > err).to(values.dtype), m)
    return loss, {"critic/vf_clipfrac": clipfrac.item()}


def _mixed_pairs(scores: torch.Tensor, group_ids) -> torch.Tensor:
    """``(bs, bs)`` bool: ``pairs[i, j]`` iff same group and ``R_i > R_j``."""
    dense = group_index(group_ids, device=scores.device)
    same = dense.unsqueeze(1) == dense.unsqueeze(0)
    return same & (scores.unsqueeze(1) > scores.unsqueeze(0))


def terminal_ranking_loss(
    terminal_values: torch.Tensor, scores: torch.Tensor, group_ids, margin: float = 0.1
) -> tuple[torch.Tensor, dict[str, float]]:
    """``L_rank = mean_{(i+, i-)} [m - V(s_{i+,T}) + V(s_{i-,T})]_+`` over mixed pairs (Eq. 11).

    Args:
        terminal_values: ``(bs,)`` values at each response's last model token (with grad).
        scores: ``(bs,)``.
        group_ids: ``(bs,)``.
        margin: m (spec: 0.1).

    Returns:
        ``(loss, metrics)``; the loss is 0 (with a graph) when the batch has no mixed pair.
    """
    pairs = _mixed_pairs(scores, group_ids).to(terminal_values.dtype)
    hinge = torch.relu(margin - terminal_values.unsqueeze(1) + terminal_values.unsqueeze(0))
    n_pairs = pairs.sum()
    loss = (hinge * pairs).sum() / n_pairs.clamp_min(1.0)
    return loss, {"li2sao/rank_pairs": float(n_pairs)}


def li2sao_critic_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    residual_targets: torch.Tensor,
    critic_mask: torch.Tensor,
    scores: torch.Tensor,
    group_ids,
    response_mask: torch.Tensor,
    clip_eps: float = 0.2,
    rank_margin: float = 0.1,
    rank_coef: float = 0.1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Bootstrap critic loss ``L_res + α L_rank`` (spec §4). ``critic_mask`` already excludes dropped
    (all-equal) groups. Shapes: values/targets/masks ``(bs, T)``, scores/group_ids ``(bs,)``."""
    res, m_res = clipped_value_loss(values, old_values, residual_targets, critic_mask, clip_eps)
    rank, m_rank = terminal_ranking_loss(
        values_at_last_model_token(values, response_mask), scores, group_ids, rank_margin
    )
    loss = res + rank_coef * rank
    return loss, {"li2sao/residual_loss": res.item(), "li2sao/rank_loss": rank.item(), **m_res, **m_rank}


# ----------------------------------------------------------------------------------------------------
# readiness (spec §4, Eq. 12-13): sufficient statistics so data-parallel shards reduce exactly
# ----------------------------------------------------------------------------------------------------
READINESS_FIELDS = ("count", "sum_z", "sum_zz", "sum_d", "sum_dd", "pairs", "pairs_correct")


def readiness_statistics(terminal_values: torch.Tensor, scores: torch.Tensor, group_ids) -> torch.Tensor:
    """Sums from which ``e_k`` and ``a_k`` follow exactly; add them across shards (``all_reduce SUM``).

    On mixed groups only, with ``Z_i = R_i - μ_g`` and ``D_i = Z_i - V(s_{i,T_i})``:
    ``[count, ΣZ, ΣZ², ΣD, ΣD², |P|, #{(i+, i-) ∈ P: V_{i+} > V_{i-}}]``. Each shard must hold whole
    groups (pairs never cross shards).

    Args:
        terminal_values: ``(bs,)``.
        scores: ``(bs,)``.
        group_ids: ``(bs,)``.

    Returns:
        ``(7,)`` float64 tensor in the order of :data:`READINESS_FIELDS`.
    """
    v = terminal_values.detach().to(torch.float64)
    r = scores.to(torch.float64)
    mean, std, _ = group_statistics(r, group_ids)
    mixed = (std > 0).to(torch.float64)
    z = (r - mean.to(torch.float64)) * mixed
    d = (z - v) * mixed
    pairs = _mixed_pairs(r, group_ids)
    correct = pairs & (v.unsqueeze(1) > v.unsqueeze(0))
    return torch.stack([
        mixed.sum(), z.sum(), (z * z).sum(), d.sum(), (d * d).sum(),
        pairs.sum().to(torch.float64), correct.sum().to(torch.float64),
    ])


def readiness_from_statistics(stats: torch.Tensor) -> tuple[Optional[float], Optional[float]]:
    """``(e_k, a_k)`` from summed statistics; ``None`` for a value that is undefined this step
    (no mixed group, ``Var[Z] = 0``, or no pair). Population variances: the ratio is the same with n-1."""
    count, sum_z, sum_zz, sum_d, sum_dd, pairs, correct = (float(x) for x in stats)
    e_k = a_k = None
    if count > 0:
        var_z = sum_zz / count - (sum_z / count) ** 2
        var_d = sum_dd / count - (sum_d / count) ** 2
        if var_z > 1e-12:
            e_k = 1.0 - var_d / var_z
    if pairs > 0:
        a_k = correct / pairs
    return e_k, a_k


@dataclass
class ReadinessGate:
    """One-way switch from group bootstrap to single rollout (spec §4).

    Each bootstrap step ``k = 1, 2, ...`` calls :meth:`update` with that step's data-parallel-reduced
    ``(e_k, a_k)``. EMAs start at 0: ``ē_k = β ē_{k-1} + (1-β) e_k``. As in the paper's pseudocode
    (App. F): if ``k ≥ T_min`` and ``ē_k > η_e`` and ``ā_k > η_a`` then ``c ← c + 1`` else ``c ← 0``; the
    gate opens at the step where ``c ≥ M`` or ``k ≥ T_max`` (so the earliest evidence-based switch is at
    ``k = T_min + M - 1``). A step where ``e_k`` or ``a_k`` is undefined (no mixed group this step) leaves
    that EMA unchanged; the condition is then read on the unchanged EMAs, exactly as the pseudocode reads
    it. Once open it stays open.
    """

    beta: float = 0.9  # β, EMA factor
    eta_e: float = 0.2  # η_e, residual explained-variance threshold
    eta_a: float = 0.65  # η_a, ranking-accuracy threshold
    patience: int = 10  # M, consecutive ready steps required
    t_min: int = 60  # T_min, minimum bootstrap steps before counting
    t_max: int = 150  # T_max, forced switch step
    # state
    step: int = 0
    ema_e: float = 0.0
    ema_a: float = 0.0
    consecutive: int = 0
    switched: bool = False
    switch_step: Optional[int] = None
    forced: bool = False
    history: list = field(default_factory=list, repr=False)

    def __post_init__(self):
        if not 0.0 <= self.beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {self.beta}")
        if self.patience < 1:
            raise ValueError(f"patience (M) must be >= 1, got {self.patience}")
        # t_min == t_max is a fixed switch step (evidence can open the gate there only with patience 1), as
        # algorithm.gate validation allows it
        if not (0 <= self.t_min <= self.t_max and self.t_max >= 1):
            raise ValueError(f"need 0 <= t_min <= t_max and t_max >= 1, got t_min={self.t_min}, t_max={self.t_max}")

    def update(self, e_k: Optional[float], a_k: Optional[float]) -> bool:
        """Record one bootstrap step; returns True exactly once, at the step the gate opens."""
        if self.switched:
            return False
        self.step += 1
        if e_k is not None:
            self.ema_e = self.beta * self.ema_e + (1.0 - self.beta) * e_k
        if a_k is not None:
            self.ema_a = self.beta * self.ema_a + (1.0 - self.beta) * a_k
        ready = self.step >= self.t_min and self.ema_e > self.eta_e and self.ema_a > self.eta_a
        self.consecutive = self.consecutive + 1 if ready else 0
        self.history.append((self.step, e_k, a_k, self.ema_e, self.ema_a, self.consecutive))
        if self.consecutive >= self.patience or self.step >= self.t_max:
            self.switched = True
            self.switch_step = self.step
            self.forced = self.consecutive < self.patience
            return True
        return False

    def state_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict) -> "ReadinessGate":
        return cls(**state)

    def metrics(self) -> dict[str, float]:
        return {
            "li2sao/ema_explained_var": self.ema_e,
            "li2sao/ema_rank_acc": self.ema_a,
            "li2sao/gate_counter": float(self.consecutive),
            "li2sao/gate_step": float(self.step),
            "li2sao/eta_e": self.eta_e,
            "li2sao/eta_a": self.eta_a,
            "li2sao/switched": float(self.switched),
        }


def readiness_metrics(old_values: torch.Tensor, scores: torch.Tensor, group_ids: list[str],
                      mask: torch.Tensor) -> dict[str, float]:
    """The Li2SAO gate's inputs e_k, a_k (Eq. 12-13) on this batch's mixed groups, read from the frozen V_old
    ``(bs, T)`` at each response's last model token; sums over the whole batch (the learner holds every
    trajectory, whichever workers trained on it). A statistic without data (no mixed group) is left out."""
    stats = readiness_statistics(values_at_last_model_token(old_values, mask), scores, group_ids)
    e_k, a_k = readiness_from_statistics(stats)
    out = {"li2sao/mixed_groups_trajectories": float(stats[0]), "li2sao/rank_pairs": float(stats[5])}
    if e_k is not None:
        out["li2sao/explained_var_residual"] = e_k
    if a_k is not None:
        out["li2sao/rank_acc"] = a_k
    return out


def li2sao_group_estimator(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index=None,
    values: Optional[torch.Tensor] = None,
    config=None,
    scores: Optional[torch.Tensor] = None,
    responses: Optional[torch.Tensor] = None,
    response_attention: Optional[torch.Tensor] = None,
    **unused,
) -> AdvantageEstimate:
    """Li2SAO's estimator (spec §4), registered in verl as ``li2sao_group``; shapes ``(bs, T)``.

    Called as stock verl's ``compute_advantage`` calls estimators (no token tensors): :func:`li2sao_advantage`,
    the group advantage on batches of groups, single-rollout GAE on singletons (which needs ``values``).

    Called by our trainer in the bootstrap phase, with ``responses`` and ``response_attention``: the group
    advantage for the actor and, for the critic, the residual targets ``Ĝ_t - μ_group`` (λ = 1, ``Ĝ = γ^k R``)
    under the divergence mask of complete mixed groups, trained with the clipped residual loss (Eq. 10,
    ``value_clip``) and the terminal ranking loss (Eq. 11); with ``values`` (V_old) also the gate's readiness
    statistics e_k, a_k and the critic's explained variance. ``returns`` are the absolute returns ``Ĝ``.

    Config keys: ``gamma`` (1.0), ``grpo_epsilon`` (1e-6), ``gae_alpha`` or verl's ``sao_alpha`` (1.5),
    ``value_clip`` (0.2), ``rank_margin`` (0.1), ``rank_coef`` (0.1).
    """
    if index is None:
        raise ValueError("li2sao_group needs `index` (verl's non_tensor_batch['uid']) to form prompt groups")
    gamma = float(config_value(config, "gamma", 1.0))
    epsilon = float(config_value(config, "grpo_epsilon", 1e-6))
    if responses is None or response_attention is None:
        advantages, returns = li2sao_advantage(
            token_level_rewards, response_mask, index, values=values, epsilon=epsilon, gamma=gamma,
            alpha=float(config_value(config, "gae_alpha", 1.5, alias="sao_alpha")))
        return AdvantageEstimate(advantages, returns)
    scores = token_level_rewards.sum(dim=-1) if scores is None else scores
    advantages = broadcast_to_tokens(grpo_group_advantage(scores, index, epsilon), response_mask)
    returns = bootstrap_returns(scores, response_mask, gamma)
    targets, keep = residual_critic_targets(returns, scores, index, response_mask)
    critic_mask = divergence_mask(responses, response_mask, scores, index, response_attention) * keep.unsqueeze(1)
    metrics: dict[str, float] = {}
    if values is not None:
        metrics.update(readiness_metrics(values, scores, index, response_mask))
        metrics.update(critic_explained_variance(values, targets, response_mask * keep.unsqueeze(1), critic_mask))
    ranking = {"scores": scores, "group_ids": index, "margin": float(config_value(config, "rank_margin", 0.1)),
               "coef": float(config_value(config, "rank_coef", 0.1))}
    return AdvantageEstimate(advantages, returns, critic_targets=targets, critic_mask=critic_mask,
                             value_clip=float(config_value(config, "value_clip", 0.2)), ranking=ranking,
                             metrics=metrics)

