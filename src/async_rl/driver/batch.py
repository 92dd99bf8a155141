"""Batches: trajectories to tensors (:func:`collate`, SAPO's :func:`turn_tensors`) and the statistics read off a
batch's trajectories (:func:`batch_metrics`). Sits between the buffer and the algorithms: the learner calls these
and does no tensor math itself (the estimators' own statistics, the critic's explained variance and the Li2SAO
gate's e_k, a_k, come with their estimates from :mod:`async_rl.algos`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Optional

import torch

from async_rl.algos import num_turns_of, policy_lag_stats
from async_rl.driver.trajectory import OBSERVATION_VERSION, Trajectory


def collate(trajectories: list[Trajectory], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a list of trajectories into batch tensors for workers and algorithms.

    Returns (``bs`` trajectories, ``P`` max prompt length, ``T`` max response length):
        ``prompts (bs, P)`` left-padded, ``prompt_mask (bs, P)``,
        ``responses (bs, T)``, ``response_attention (bs, T)`` (1 on every real response token),
        ``response_mask (bs, T)`` (1 on model tokens), ``behaviour_log_probs (bs, T)``,
        ``token_versions (bs, T)`` (-1 off model tokens), ``token_turn_index (bs, T)``,
        ``token_level_rewards (bs, T)`` (outcome on the last model token), ``scores (bs,)``.
    """
    bs = len(trajectories)
    if bs == 0:
        raise ValueError("cannot collate an empty batch")
    P = max(len(t.prompt_ids) for t in trajectories)
    T = max(max(len(t.response_ids) for t in trajectories), 1)
    prompts = torch.full((bs, P), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(bs, P, dtype=torch.long)
    responses = torch.full((bs, T), pad_token_id, dtype=torch.long)
    attention = torch.zeros(bs, T, dtype=torch.long)
    mask = torch.zeros(bs, T, dtype=torch.float32)
    logprobs = torch.zeros(bs, T, dtype=torch.float32)
    versions = torch.full((bs, T), OBSERVATION_VERSION, dtype=torch.long)
    turn_index = torch.full((bs, T), -1, dtype=torch.long)
    rewards = torch.zeros(bs, T, dtype=torch.float32)
    for i, t in enumerate(trajectories):
        p = len(t.prompt_ids)
        prompts[i, P - p:] = torch.tensor(t.prompt_ids, dtype=torch.long)
        prompt_mask[i, P - p:] = 1
        n = len(t.response_ids)
        if n:
            responses[i, :n] = torch.tensor(t.response_ids, dtype=torch.long)
            attention[i, :n] = 1
            m = torch.tensor(t.response_mask, dtype=torch.float32)
            mask[i, :n] = m
            logprobs[i, :n] = torch.tensor(t.behaviour_logprobs, dtype=torch.float32)
            versions[i, :n] = torch.tensor(t.versions, dtype=torch.long)
            turn_index[i, :n] = torch.tensor(t.token_turn_index, dtype=torch.long)
            model_pos = torch.nonzero(m).flatten()
            if model_pos.numel():
                rewards[i, int(model_pos[-1])] = float(t.reward)
    return {
        "prompts": prompts, "prompt_mask": prompt_mask, "responses": responses,
        "response_attention": attention, "response_mask": mask, "behaviour_log_probs": logprobs,
        "token_versions": versions, "token_turn_index": turn_index, "token_level_rewards": rewards,
        "scores": torch.tensor([float(t.reward) for t in trajectories]),
    }


def mark_current_version(batch: dict[str, torch.Tensor], policy_version: int) -> None:
    """Adds ``current_version_mask`` ``(bs, T)``: tokens sampled by the trainer's current weights, for the
    engine-vs-trainer mismatch metrics (docs/metrics.md)."""
    batch["current_version_mask"] = batch["token_versions"] == policy_version


# ----------------------------------------------------------------------------------------------------
# SAPO's turn tensors (spec §5): built in the driver, which holds the trajectories
# ----------------------------------------------------------------------------------------------------
def turn_tensors(trajectories_or_batch, num_turns: Optional[int] = None) -> dict[str, torch.Tensor]:
    """``(bs, K)`` turn tensors: ``turn_rewards``, ``turn_dones``, ``turn_mask``, ``turn_invalid`` (float32).

    Args:
        trajectories_or_batch: either the list of :class:`~async_rl.driver.trajectory.Trajectory` the
            batch was collated from (same order), or a collated batch dict. From trajectories, turn ``k``
            exists when ``k < max(len(turn_rewards), last model turn + 1)`` *and* it has at least one
            model token (a turn without model tokens has no V/Q boundary and is masked out); rewards,
            dones and invalid flags come from the per-turn lists; a trajectory without ``turn_rewards``
            (single-turn tasks) gets its outcome ``reward`` on its last turn. A batch dict that already
            holds the turn tensors is passed through; otherwise they are derived from
            ``token_turn_index`` and ``token_level_rewards`` (reward of a turn = sum of its token rewards,
            last turn done, no invalid flags).
        num_turns: pad to this ``K`` (default: the largest turn count in the batch).

    Returns:
        dict of ``(bs, K)`` float32 tensors.
    """
    keys = ("turn_rewards", "turn_dones", "turn_mask", "turn_invalid")
    if isinstance(trajectories_or_batch, Mapping):
        batch = trajectories_or_batch
        if all(k in batch for k in keys[:3]):
            out = {k: batch[k].to(torch.float32) for k in keys if k in batch}
            out.setdefault("turn_invalid", torch.zeros_like(out["turn_mask"]))
            return _pad_turns(out, num_turns)
        tti = batch["token_turn_index"].long()
        K = num_turns or num_turns_of(tti)
        bs = tti.shape[0]
        model = tti >= 0
        slot = tti.clamp_min(0)
        rewards = torch.zeros(bs, K).scatter_add_(1, slot, batch["token_level_rewards"].float() * model)
        has_tokens = torch.zeros(bs, K).scatter_add_(1, slot, model.float()) > 0
        mask = has_tokens.float()
        last = (mask * torch.arange(1, K + 1)).argmax(dim=1)
        dones = torch.zeros(bs, K).scatter_(1, last.unsqueeze(1), 1.0) * mask
        return {"turn_rewards": rewards, "turn_dones": dones, "turn_mask": mask,
                "turn_invalid": torch.zeros(bs, K)}

    trajectories = list(trajectories_or_batch)
    if not trajectories:
        raise ValueError("turn_tensors needs at least one trajectory")
    counts, model_turns = [], []
    for t in trajectories:
        turns_with_tokens = {s.turn for s in t.segments if s.kind == "model" and len(s.token_ids) > 0}
        model_turns.append(turns_with_tokens)
        counts.append(max(len(t.turn_rewards), max(turns_with_tokens, default=-1) + 1))
    K = max(max(counts), 1) if num_turns is None else num_turns
    if K < max(counts):
        raise ValueError(f"num_turns={K} is smaller than the longest trajectory ({max(counts)} turns)")
    bs = len(trajectories)
    rewards, dones, mask, invalid = (torch.zeros(bs, K) for _ in range(4))
    for i, t in enumerate(trajectories):
        for k in range(counts[i]):
            mask[i, k] = float(k in model_turns[i])
            if k < len(t.turn_rewards):
                rewards[i, k] = float(t.turn_rewards[k])
            if k < len(t.turn_dones):
                dones[i, k] = float(bool(t.turn_dones[k]))
            if k < len(t.turn_invalid):
                invalid[i, k] = float(bool(t.turn_invalid[k]))
        if not t.turn_rewards and model_turns[i]:
            last = max(model_turns[i])
            rewards[i, last] = float(t.reward)
            dones[i, last] = float(not t.truncated)
    return {"turn_rewards": rewards, "turn_dones": dones, "turn_mask": mask, "turn_invalid": invalid}


def _pad_turns(turns: dict[str, torch.Tensor], num_turns: Optional[int]) -> dict[str, torch.Tensor]:
    if num_turns is None:
        return turns
    K = next(iter(turns.values())).shape[1]
    if K > num_turns:
        raise ValueError(f"turn tensors have K={K} > num_turns={num_turns}")
    return {k: torch.nn.functional.pad(v, (0, num_turns - K)) for k, v in turns.items()}


# ----------------------------------------------------------------------------------------------------
# statistics of a batch (docs/metrics.md)
# ----------------------------------------------------------------------------------------------------
def batch_metrics(trajectories: list[Trajectory], batch: Mapping[str, torch.Tensor],
                  policy_version: int) -> dict[str, float]:
    """``train/*`` (reward, success, lengths, turns, tool calls) and the policy-lag statistics of ``batch``
    (collated from ``trajectories``) against the trainer's ``policy_version``."""
    n_model = batch["response_mask"].sum(dim=1)
    out = {
        "train/reward_mean": float(batch["scores"].mean()),
        "train/success_rate": sum(t.success for t in trajectories) / len(trajectories),
        "train/batch_trajectories": float(len(trajectories)),
        "train/response_length/mean": float(n_model.mean()),
        "train/response_length/max": float(n_model.max()),
        "train/num_turns/mean": sum(t.num_turns for t in trajectories) / len(trajectories),
        "train/tool_calls": float(sum(t.info.get("tool_calls", 0) for t in trajectories)),
    }
    out.update(policy_lag_stats(batch["token_versions"], policy_version, batch["response_mask"]))
    return {k: (v if not (isinstance(v, float) and math.isnan(v)) else float("nan")) for k, v in out.items()}
