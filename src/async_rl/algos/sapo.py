"""SAPO math: one backbone for policy, V and Q, read from two reserved logits (spec §5; sapo paper §4).

Shapes: ``B`` trajectories, ``K`` turns (padded), ``T`` response positions, ``V`` vocabulary size.
A *turn* is one model action (a span of model tokens) followed by an environment observation.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from async_rl.algos._util import masked_mean
from async_rl.algos.estimate import AdvantageEstimate, config_value


# ----------------------------------------------------------------------------------------------------
# readout and restricted softmax
# ----------------------------------------------------------------------------------------------------
def normalised_readout(z_plus: torch.Tensor, z_minus: torch.Tensor, tau_v: float) -> torch.Tensor:
    """``p(c) = clip((z_{w+}(c) - z_{w-}(c)) / τ_v, -1, 1)``; any shape."""
    if tau_v <= 0:
        raise ValueError(f"tau_v must be > 0, got {tau_v}")
    return ((z_plus - z_minus) / tau_v).clamp(-1.0, 1.0)


def two_logit_value(z_plus: torch.Tensor, z_minus: torch.Tensor, tau_v: float, r_max: float) -> torch.Tensor:
    """``V = R_max · clip((z+ - z-)/τ_v, -1, 1)`` (also Q, read at the action boundary); any shape."""
    return r_max * normalised_readout(z_plus, z_minus, tau_v)


def _banned_mask(vocab_size: int, reserved_ids: Sequence[int], device) -> torch.Tensor:
    ids = torch.as_tensor(list(reserved_ids), dtype=torch.long, device=device)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"reserved ids {list(reserved_ids)} outside the vocabulary [0, {vocab_size})")
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    mask[ids] = True
    return mask


def restricted_log_softmax(logits: torch.Tensor, reserved_ids: Sequence[int], temperature: float = 1.0) -> torch.Tensor:
    """log-softmax over ``W_act = W \\ {w+, w-}`` (spec §5): reserved entries get ``-inf`` and receive no
    gradient. ``(..., V) -> (..., V)``."""
    banned = _banned_mask(logits.shape[-1], reserved_ids, logits.device)
    scaled = logits / temperature if temperature != 1.0 else logits
    return torch.log_softmax(scaled.masked_fill(banned, float("-inf")), dim=-1)


def restricted_token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, reserved_ids: Sequence[int], temperature: float = 1.0
) -> torch.Tensor:
    """Log-prob of ``labels`` under the restricted softmax: ``(B, T, V), (B, T) -> (B, T)``."""
    logp = restricted_log_softmax(logits, reserved_ids, temperature)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def restricted_entropy(logits: torch.Tensor, reserved_ids: Sequence[int]) -> torch.Tensor:
    """Entropy of the restricted policy: ``(..., V) -> (...)``. Finite, with zero gradient to reserved ids."""
    logp = restricted_log_softmax(logits, reserved_ids)
    banned = torch.isinf(logp)
    # zero the -inf entries before multiplying: 0 * -inf would put NaN into the backward pass
    safe_logp = logp.masked_fill(banned, 0.0)
    return -(safe_logp.exp() * safe_logp).sum(dim=-1)


# ----------------------------------------------------------------------------------------------------
# turn structure
# ----------------------------------------------------------------------------------------------------
def turn_boundaries(token_turn_index: torch.Tensor, num_turns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """First and last response position of each turn's model tokens.

    The V readout of turn k is at the position *before* ``first`` (it predicts the first action token);
    the Q readout is at ``last`` (the last valid action token).

    Args:
        token_turn_index: ``(B, T)`` int64 turn index of each model token, ``-1`` elsewhere.
        num_turns: ``K``.

    Returns:
        ``(first, last)``, ``(B, K)`` int64, ``-1`` for a turn that does not exist.
    """
    B, T = token_turn_index.shape
    device = token_turn_index.device
    pos = torch.arange(T, device=device).expand(B, T)
    is_model = token_turn_index >= 0
    slot = token_turn_index.clamp_min(0)
    big = torch.full((B, num_turns), T, dtype=torch.long, device=device)
    first = big.scatter_reduce(1, slot, torch.where(is_model, pos, T), reduce="amin", include_self=True)
    last = torch.full((B, num_turns), -1, dtype=torch.long, device=device).scatter_reduce(
        1, slot, torch.where(is_model, pos, -1), reduce="amax", include_self=True)
    first = torch.where(first == T, -1, first)
    return first, last


def broadcast_turns_to_tokens(turn_values: torch.Tensor, token_turn_index: torch.Tensor) -> torch.Tensor:
    """Write each turn's value on its model tokens: ``(B, K), (B, T) -> (B, T)``, 0 off model tokens."""
    gathered = turn_values.gather(1, token_turn_index.clamp_min(0))
    return gathered * (token_turn_index >= 0).to(turn_values.dtype)


# ----------------------------------------------------------------------------------------------------
# turn-level targets from frozen old values
# ----------------------------------------------------------------------------------------------------
def _terminal_flags(dones: torch.Tensor, turn_mask: torch.Tensor) -> torch.Tensor:
    """Done flags with the last valid turn forced terminal (horizon truncation bootstraps 0)."""
    K = turn_mask.shape[1]
    valid = turn_mask.bool()
    if K == 0:  # no turns: nothing is terminal (argmax has no column to pick)
        return torch.zeros(turn_mask.shape, dtype=torch.float32, device=turn_mask.device)
    last_valid = (valid.to(torch.long) * torch.arange(1, K + 1, device=valid.device)).argmax(dim=1)
    is_last = torch.zeros_like(valid).scatter_(1, last_valid.unsqueeze(1), True) & valid
    return (dones.bool() | is_last | ~valid).to(torch.float32)


def turn_gae(
    rewards: torch.Tensor,
    old_values: torch.Tensor,
    dones: torch.Tensor,
    turn_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> torch.Tensor:
    """Turn-level GAE (spec §5): ``δ_t = r_t + γ(1-d_t) V_old(t+1) - V_old(t)``,
    ``A_t = δ_t + γλ(1-d_t) A_{t+1}``, ``A_{K+1} = 0``; the last valid turn is terminal.

    Args:
        rewards, old_values, dones, turn_mask: ``(B, K)``; ``turn_mask`` 1 on turns that exist.

    Returns:
        ``(B, K)`` advantages, 0 on padded turns.
    """
    r = rewards.to(torch.float32)
    v = old_values.detach().to(torch.float32)
    done = _terminal_flags(dones, turn_mask)
    valid = turn_mask.to(torch.float32)
    next_v = torch.nn.functional.pad(v[:, 1:], (0, 1))
    delta = (r + gamma * (1 - done) * next_v - v) * valid
    adv = torch.zeros_like(delta)
    running = delta.new_zeros(delta.shape[0])
    for t in range(delta.shape[1] - 1, -1, -1):  # K <= max turns (50): the recursion needs the loop
        running = delta[:, t] + gamma * lam * (1 - done[:, t]) * running
        adv[:, t] = running
    return adv * valid


def sapo_targets(
    rewards: torch.Tensor,
    old_values: torch.Tensor,
    old_q_values: torch.Tensor,
    dones: torch.Tensor,
    turn_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Turn GAE advantage, ``y^V_t = V_old(t) + A_t`` and SARSA ``y^Q_t = r_t + γ(1-d_t) Q_old(t+1)``.

    All inputs and outputs ``(B, K)``; outputs 0 on padded turns.
    """
    adv = turn_gae(rewards, old_values, dones, turn_mask, gamma, lam)
    valid = turn_mask.to(torch.float32)
    done = _terminal_flags(dones, turn_mask)
    y_v = (old_values.detach().to(torch.float32) + adv) * valid
    next_q = torch.nn.functional.pad(old_q_values.detach().to(torch.float32)[:, 1:], (0, 1))
    y_q = (rewards.to(torch.float32) + gamma * (1 - done) * next_q) * valid
    return adv, y_v, y_q


def normalise_turn_advantages(
    advantages: torch.Tensor,
    turn_mask: torch.Tensor,
    invalid_action: Optional[torch.Tensor] = None,
    invalid_penalty: float = 0.0,
    eps: float = 1e-6,
) -> torch.Tensor:
    """``Ã = A - c_inv · m^inv``, then ``Â = (Ã - μ_B) / (σ_B + ε)`` over the valid turns of the batch.

    Args:
        advantages, turn_mask: ``(B, K)``.
        invalid_action: optional ``(B, K)`` 0/1 invalid-action indicator from the env.
        invalid_penalty: c_inv.

    Returns:
        ``(B, K)``, 0 on padded turns. σ_B is the population std over valid turns.
    """
    valid = turn_mask.to(torch.float32)
    a = advantages.to(torch.float32)
    if invalid_action is not None:
        a = a - invalid_penalty * invalid_action.to(torch.float32)
    mu = masked_mean(a, valid)
    sigma = torch.sqrt(masked_mean((a - mu) ** 2, valid))
    return (a - mu) / (sigma + eps) * valid


# ----------------------------------------------------------------------------------------------------
# losses
# ----------------------------------------------------------------------------------------------------
def turn_value_loss(
    readout: torch.Tensor,
    old_readout: torch.Tensor,
    targets: torch.Tensor,
    turn_mask: torch.Tensor,
    clip_eps: float,
    r_max: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss in normalised space, averaged over valid *turns* (spec §5):

        ȳ = clip(y / R_max, -1, 1),   p^clip = p_old + clip(p - p_old, -ε, ε),
        L = ½ mean_turns max((p - ȳ)², (p^clip - ȳ)²)

    Args:
        readout: ``(B, K)`` current normalised readout p (with grad).
        old_readout: ``(B, K)`` p_old.
        targets: ``(B, K)`` y^V or y^Q in reward units.
        turn_mask: ``(B, K)``.
        clip_eps: ε_V or ε_Q.
        r_max: R_max.

    Returns:
        ``(loss, clipfrac)``.
    """
    valid = turn_mask.to(readout.dtype)
    y = (targets / r_max).clamp(-1.0, 1.0).detach()
    old = old_readout.detach()
    clipped = old + (readout - old).clamp(-clip_eps, clip_eps)
    err = (readout - y) ** 2
    err_clip = (clipped - y) ** 2
    loss = 0.5 * (torch.maximum(err, err_clip) * valid).sum() / valid.sum().clamp_min(1.0)
    return loss, masked_mean((err_clip > err).to(readout.dtype), valid)


def ppo_clip_token_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_eps: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level PPO clip with turn advantages broadcast to tokens; token-mean. ``(B, T)`` inputs.
    Returns ``(loss, clipfrac)``."""
    m = response_mask.to(log_prob.dtype)
    ratio = torch.exp((log_prob - old_log_prob).clamp(-20.0, 20.0))
    pg = -advantages * ratio
    pg_clip = -advantages * ratio.clamp(1 - clip_eps, 1 + clip_eps)
    loss = (torch.maximum(pg, pg_clip) * m).sum() / m.sum().clamp_min(1.0)
    return loss, masked_mean((pg_clip > pg).to(log_prob.dtype), m)


def sapo_total_loss(
    policy_loss: torch.Tensor,
    v_loss: torch.Tensor,
    q_loss: torch.Tensor,
    kl: torch.Tensor,
    entropy: torch.Tensor,
    c_v: float,
    c_q: float,
    kl_coef: float,
    c_h: float,
) -> torch.Tensor:
    """``L_pol + c_V L_V + c_Q L_Q + β L_KL - c_H H`` (spec §5), one backward through the backbone."""
    return policy_loss + c_v * v_loss + c_q * q_loss + kl_coef * kl - c_h * entropy


def num_turns_of(token_turn_index: torch.Tensor) -> int:
    """``K`` = largest turn index on a model token + 1 (at least 1)."""
    return max(int(token_turn_index.max()) + 1, 1) if token_turn_index.numel() else 1


# ----------------------------------------------------------------------------------------------------
# the registered estimator ("sapo_turn") and the frozen targets of one update
# ----------------------------------------------------------------------------------------------------
def sapo_turn_estimator(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    turn_rewards: Optional[torch.Tensor] = None,
    old_turn_values: Optional[torch.Tensor] = None,
    old_turn_q_values: Optional[torch.Tensor] = None,
    turn_dones: Optional[torch.Tensor] = None,
    turn_mask: Optional[torch.Tensor] = None,
    token_turn_index: Optional[torch.Tensor] = None,
    invalid_action: Optional[torch.Tensor] = None,
    config: Any = None,
    **unused: Any,
) -> AdvantageEstimate:
    """SAPO's turn advantage and V/Q targets (spec §5), registered in verl as ``sapo_turn``.

    Turn GAE ``A`` on the frozen ``V_old``, ``y^V = V_old + A``, SARSA ``y^Q = r + γ(1-d) Q_old(t+1)``; then
    ``Â = (A - c_inv · invalid - μ_B) / (σ_B + ε)`` over the valid turns of the whole batch, broadcast to the model
    tokens of each turn.

    Args:
        token_level_rewards: ``(bs, T)``, unused (the turn rewards carry them); verl passes it.
        response_mask: ``(bs, T)`` 1 on model tokens.
        turn_rewards, turn_dones, turn_mask: ``(bs, K)``; ``turn_mask`` 1 on turns that exist and have a V/Q
            boundary (the batch's turn mask times the readouts', ``SapoRole.readouts``).
        old_turn_values, old_turn_q_values: ``(bs, K)`` V_old and Q_old read from the backbone before the update.
        token_turn_index: ``(bs, T)`` turn of each response token (-1 off model tokens).
        invalid_action: optional ``(bs, K)`` 0/1 invalid-action flags (``turn_invalid`` is accepted too).
        config: ``gamma`` (1.0), ``sapo_lambda`` or ``lam`` (0.95), ``sapo_invalid_penalty`` (c_inv; 0.0 when the
            config has none: ``algorithm.sapo_invalid_penalty``'s default, 0.1, comes with our AlgorithmConfig).

    Returns:
        :class:`AdvantageEstimate` ``(token advantages (bs, T), y^V (bs, K))`` with ``turn_targets``
        ``{turn_mask, advantages, norm_advantages, y_v, y_q}``. Stock verl's ``compute_advantage`` passes none of
        the turn tensors: call the registered function with them, as async_rl's driver does.
    """
    if invalid_action is None:
        invalid_action = unused.get("turn_invalid")
    needed = dict(turn_rewards=turn_rewards, old_turn_values=old_turn_values, old_turn_q_values=old_turn_q_values,
                  turn_dones=turn_dones, turn_mask=turn_mask, token_turn_index=token_turn_index)
    missing = [k for k, v in needed.items() if v is None]
    if missing:
        raise ValueError(
            f"sapo_turn needs turn-level tensors {missing}; verl's compute_advantage does not pass them. "
            "Call the registered function with them (async_rl.driver.learner.shared_backbone_targets does)."
        )
    gamma = float(config_value(config, "gamma", 1.0))
    lam = float(config_value(config, "sapo_lambda", 0.95, alias="lam"))
    invalid_penalty = float(config_value(config, "sapo_invalid_penalty", 0.0)) if invalid_action is not None else 0.0
    turn_mask = turn_mask.to(torch.float32)
    adv, y_v, y_q = sapo_targets(turn_rewards.to(torch.float32), old_turn_values, old_turn_q_values,
                                 turn_dones.to(torch.float32), turn_mask, gamma, lam)
    norm = normalise_turn_advantages(adv, turn_mask, invalid_action, invalid_penalty)
    token_advantages = broadcast_turns_to_tokens(norm, token_turn_index.long()) * response_mask.to(torch.float32)
    return AdvantageEstimate(token_advantages, y_v, turn_targets={
        "turn_mask": turn_mask, "advantages": adv, "norm_advantages": norm, "y_v": y_v, "y_q": y_q})


def sapo_update_targets(readouts: Mapping[str, torch.Tensor], estimate: AdvantageEstimate) -> dict[str, torch.Tensor]:
    """The frozen targets of one SAPO update (spec §5): the estimate's turn targets, the old readouts on its
    valid turns (``v_old``, ``q_old``, ``p_v_old``, ``p_q_old``, for the clipped V/Q losses), the token
    advantages, and the old and reference log-probs the readouts carry. All ``(bs, K)`` or ``(bs, T)``."""
    turns = estimate.turn_targets
    if turns is None:
        raise ValueError("sapo_update_targets needs a sapo_turn estimate (its turn_targets)")
    valid = turns["turn_mask"]
    targets = {**turns, "v_old": readouts["values"] * valid, "q_old": readouts["q_values"] * valid,
               "p_v_old": readouts["p_v"] * valid, "p_q_old": readouts["p_q"] * valid,
               "token_advantages": estimate.advantages, "old_log_probs": readouts["log_probs"]}
    if "ref_log_probs" in readouts:
        targets["ref_log_probs"] = readouts["ref_log_probs"]
    return targets
