"""Diagnostics the papers plot (spec §1, §3, §6): explained variance, policy lag, pass@k."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(G - V) / Var(G)`` over masked entries (spec §3). NaN when ``Var(G) = 0``.

    Args:
        values, returns, mask: ``(bs, T)`` (or any equal shapes).
    """
    m = mask.bool()
    g = returns[m].to(torch.float64)
    v = values[m].to(torch.float64)
    if g.numel() < 2:
        return float("nan")
    var_g = g.var(unbiased=False)
    if var_g <= 1e-12:
        return float("nan")
    return float(1.0 - (g - v).var(unbiased=False) / var_g)


def policy_lag_stats(
    token_versions: torch.Tensor, trainer_version: int, response_mask: torch.Tensor
) -> dict[str, float]:
    """Per-token policy lag = trainer version - version that sampled the token (spec §1).

    Args:
        token_versions: ``(bs, T)`` int policy version of each model token.
        trainer_version: the version the trainer is about to update.
        response_mask: ``(bs, T)``.

    Returns:
        ``async/policy_lag/mean``, ``async/policy_lag/max`` and ``async/off_policy_token_ratio`` (fraction
        of model tokens more than one version behind; a one-step lag counts as on-policy).
    """
    m = response_mask.bool()
    lag = (trainer_version - token_versions)[m].to(torch.float64)
    if lag.numel() == 0:
        return {"async/policy_lag/mean": 0.0, "async/policy_lag/max": 0.0, "async/off_policy_token_ratio": 0.0}
    return {
        "async/policy_lag/mean": float(lag.mean()),
        "async/policy_lag/max": float(lag.max()),
        "async/off_policy_token_ratio": float((lag > 1).to(torch.float64).mean()),
    }


def pass_at_k(n, c, k: int) -> np.ndarray:
    """Unbiased pass@k (Chen et al. 2021): ``1 - C(n-c, k) / C(n, k)``, vectorised over problems.

    Evaluated in log space with ``lgamma`` so large ``n`` never overflows a binomial coefficient.

    Args:
        n: samples per problem (scalar or array).
        c: correct samples per problem (array).
        k: k <= n.

    Returns:
        float64 array of pass@k per problem.
    """
    c_t = torch.as_tensor(np.asarray(c), dtype=torch.float64)
    n_t = torch.as_tensor(np.asarray(n), dtype=torch.float64).expand_as(c_t)
    if bool((k > n_t).any()):
        raise ValueError(f"k={k} exceeds the number of samples n={int(n_t.min())}")
    if bool(((c_t < 0) | (c_t > n_t)).any()):
        raise ValueError("need 0 <= c <= n for every problem")
    fails = n_t - c_t
    enough_fails = fails >= k
    safe_fails = torch.where(enough_fails, fails, torch.full_like(fails, float(k)))
    # log C(n-c, k) - log C(n, k); the k! terms cancel
    log_ratio = (torch.lgamma(safe_fails + 1) - torch.lgamma(safe_fails - k + 1)
                 - torch.lgamma(n_t + 1) + torch.lgamma(n_t - k + 1))
    estimate = torch.where(enough_fails, 1.0 - torch.exp(log_ratio), torch.ones_like(c_t))
    # no correct sample: exactly 0 (lgamma's round-off left +-1e-16 there, e.g. 1.1e-16 for n = 4, k = 2)
    return torch.where(c_t == 0, torch.zeros_like(c_t), estimate).numpy()


def mismatch_sums(behaviour_log_probs: torch.Tensor, trainer_log_probs: torch.Tensor, response_mask: torch.Tensor,
                  current_mask: torch.Tensor, dis_low: float, dis_high: float) -> dict[str, torch.Tensor]:
    """Sums (to add over micro-batches and ranks) of the engine-vs-trainer gap (spec §1, §3).

    Over tokens sampled at the trainer's current version (``current_mask``; the trainer's log-prob then has the
    sampling weights, so any gap is numerics): ``kl`` = k3 estimate of KL(behaviour || trainer) with
    r = exp(trainer - behaviour), k3 = (r - 1) - log r, ``abs`` = |trainer - behaviour|, ``n`` their count.
    Over all response tokens: ``dis_masked`` = tokens whose ratio r lies outside the DIS band (low, high),
    ``n_all`` their count. All float64 scalars.
    """
    m = response_mask.bool()
    cur = m & current_mask.bool()
    log_r = (trainer_log_probs.double() - behaviour_log_probs.double())
    k3 = torch.expm1(log_r) - log_r
    ratio = torch.exp(log_r)
    outside = ~((ratio > dis_low) & (ratio < dis_high))
    return {"kl": k3[cur].sum(), "abs": log_r.abs()[cur].sum(), "n": cur.sum().double(),
            "dis_masked": outside[m].sum().double(), "n_all": m.sum().double()}


# the keys of :func:`mismatch_metrics`: global values on every rank (built from all-reduced sums)
MISMATCH_METRIC_KEYS = ("rollout/mismatch_kl", "rollout/mismatch_abs_logprob_mean", "rollout/mismatch_tokens",
                        "rollout/dis_band_masked_frac")


def mismatch_metrics(sums: dict[str, float]) -> dict[str, float]:
    """``rollout/mismatch_kl``, ``rollout/mismatch_abs_logprob_mean`` (0 when no token is at the current version),
    ``rollout/mismatch_tokens`` and ``rollout/dis_band_masked_frac`` from :func:`mismatch_sums` totals."""
    n, n_all = float(sums["n"]), float(sums["n_all"])
    return {"rollout/mismatch_kl": float(sums["kl"]) / n if n else 0.0,
            "rollout/mismatch_abs_logprob_mean": float(sums["abs"]) / n if n else 0.0,
            "rollout/mismatch_tokens": n,
            "rollout/dis_band_masked_frac": float(sums["dis_masked"]) / n_all if n_all else 0.0}


def critic_explained_variance(old_values: torch.Tensor, targets: torch.Tensor, token_mask: torch.Tensor,
                              loss_mask: Optional[torch.Tensor]) -> dict[str, float]:
    """Explained variance ``1 - Var(G - V)/Var(G)`` of V_old against the critic's own target, three ways:
    over every model token (``critic/ev_tokens``, also ``critic/explained_var``), at each response's last
    model token only (``critic/ev_terminal``; in the bootstrap this is e_k), and, in the bootstrap, over
    the divergence mask the residual loss is trained on (``critic/ev_loss_mask``). Tensors ``(bs, T)``."""
    ev_tokens = explained_variance(old_values, targets, token_mask)
    terminal = torch.zeros_like(token_mask)
    last = token_mask.shape[1] - 1 - torch.flip(token_mask, dims=[1]).argmax(dim=1)
    rows = token_mask.sum(dim=1) > 0
    terminal[rows.nonzero().squeeze(1), last[rows]] = 1.0
    out = {"critic/ev_tokens": ev_tokens, "critic/explained_var": ev_tokens,
           "critic/ev_terminal": explained_variance(old_values, targets, terminal)}
    if loss_mask is not None:
        out["critic/ev_loss_mask"] = explained_variance(old_values, targets, loss_mask)
    return out
