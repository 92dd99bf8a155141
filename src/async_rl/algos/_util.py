"""Small tensor helpers shared by the algorithm functions (no Ray, no models)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def group_index(group_ids: torch.Tensor | np.ndarray | Sequence, device: torch.device | None = None) -> torch.Tensor:
    """Map arbitrary group ids (strings, uuids, ints) to dense ids ``0..G-1``.

    Args:
        group_ids: ``(bs,)`` ids; equal ids mean "same prompt group".

    Returns:
        ``(bs,)`` int64 tensor of dense group ids in order of first appearance.
    """
    if isinstance(group_ids, torch.Tensor):
        _, dense = torch.unique(group_ids, return_inverse=True)
        return dense.to(device if device is not None else group_ids.device)
    ids = np.asarray(group_ids, dtype=object)
    # np.unique on object arrays needs comparable items; strings and ints both are.
    _, dense = np.unique(ids.astype(str), return_inverse=True)
    return torch.as_tensor(dense.reshape(-1), dtype=torch.long, device=device)


def last_true_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last nonzero entry of each row; ``-1`` for an all-zero row.

    Args:
        mask: ``(bs, T)``.

    Returns:
        ``(bs,)`` int64.
    """
    T = mask.shape[-1]
    positions = torch.arange(T, device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.full_like(positions, -1)).amax(dim=-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``mask``; 0 when the mask is empty (never NaN)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


def loss_denominator(local_count: torch.Tensor, loss_normaliser=None) -> torch.Tensor:
    """What a loss's masked sum is divided by: ``loss_normaliser`` (e.g. the count summed over ranks) or the local
    count, at least 1, so that a batch with nothing masked in (count 0 on every rank) gives a loss of 0, not 0/0."""
    denom = local_count if loss_normaliser is None else torch.as_tensor(loss_normaliser, dtype=torch.float32)
    return denom.clamp_min(1.0)
