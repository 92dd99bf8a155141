"""A verl ``DataProto`` back to the driver's batch dict, and zero-weight padding for data parallelism (a role call is
packed by :mod:`async_rl.workers.role_calls`).

Tensors travel in ``.batch``, per-row python objects in ``.non_tensor_batch``, settings and metrics in
``.meta_info``. Under DP every rank must get the same number of rows, so :func:`pad_proto_for_dp` adds
**zero-weight rows** (unlike verl's auto-padding, which repeats real rows and would change a training step) and
:func:`unpad` drops them from the outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from verl.protocol import DataProto


# the columns every model forward reads
MODEL_INPUT_KEYS = ("prompts", "prompt_mask", "responses", "response_attention")
# columns set to 0 on the rows added by :func:`pad_proto_for_dp` unless the call names its own (no loss weight)
ZERO_WEIGHT_KEYS = ("response_mask",)


def object_array(values: Sequence[Any]) -> np.ndarray:
    """A 1-D object array (``np.array`` would build a 2-D array from equal-length lists)."""
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def proto_to_batch(proto: DataProto) -> dict[str, Any]:
    """A DataProto's per-row data as a batch dict: tensors as tensors, non-tensor columns as python lists
    (``meta_info`` stays on the proto)."""
    out: dict[str, Any] = {}
    if proto.batch is not None:
        for key in proto.batch.keys():
            out[key] = proto.batch[key]
    for key, value in proto.non_tensor_batch.items():
        out[key] = list(value)
    return out


def pad_proto_for_dp(proto: DataProto, world_size: int,
                     zero_keys: Sequence[str] = ZERO_WEIGHT_KEYS) -> tuple[DataProto, int]:
    """Pad ``proto`` to a multiple of ``world_size`` rows with **zero-weight** rows.

    The added rows copy the last row, with ``zero_keys`` (masks, advantages) set to 0 and a unique
    ``group_ids`` entry each (so they form no ranking pairs): they change neither a loss nor its
    global normaliser, but keep every rank's micro-batch count equal. Returns ``(padded, n_added)``.
    """
    n = len(proto)
    if n == 0:
        raise ValueError("cannot dispatch an empty batch")
    pad = (-n) % world_size
    if pad == 0:
        return proto, 0
    tensors = {}
    if proto.batch is not None:
        for key in proto.batch.keys():
            value = proto.batch[key]
            extra = value[-1:].expand(pad, *value.shape[1:]).clone()
            if key in zero_keys:
                extra.zero_()
            tensors[key] = torch.cat([value, extra])
    non_tensors = {}
    for key, value in proto.non_tensor_batch.items():
        extra = [f"__dp_pad_{i}__" for i in range(pad)] if key.endswith("group_ids") else [value[-1]] * pad
        non_tensors[key] = object_array(list(value) + extra)
    padded = DataProto.from_dict(tensors=tensors or None, non_tensors=non_tensors, meta_info=dict(proto.meta_info))
    return padded, pad


def unpad(proto: DataProto, n_added: int) -> DataProto:
    return proto if n_added == 0 else proto.select_idxs(list(range(len(proto) - n_added)))


def check_keys(proto: DataProto, required: Sequence[str], where: str) -> None:
    """Raise before any collective, identically on every rank (each gets the same keys)."""
    if not isinstance(proto, DataProto):
        raise TypeError(f"{where} expects a DataProto, got {type(proto).__name__}")
    have = set(proto.batch.keys()) if proto.batch is not None else set()
    missing = [k for k in required if k not in have]
    if missing:
        raise KeyError(f"{where}: DataProto.batch is missing {missing} (has {sorted(have)})")
    shape = tuple(proto.batch["responses"].shape)
    for key in required:
        if key.startswith("prompt"):
            continue
        if tuple(proto.batch[key].shape) != shape:
            raise ValueError(f"{where}: {key} has shape {tuple(proto.batch[key].shape)}, responses {shape}")


def metrics_from_proto(proto: DataProto) -> dict[str, float]:
    """Metrics a DP method returned in ``meta_info["metrics"]`` (verl's concat turns them into one
    list per key, one entry per rank; the workers already reduced them over the group, so the
    entries agree and their mean is returned)."""
    metrics = proto.meta_info.get("metrics", {}) or {}
    if isinstance(metrics, list):  # a single worker's dict wrapped by concat
        metrics = {k: [m[k] for m in metrics] for k in metrics[0]} if metrics else {}
    return {k: float(np.mean(v)) if isinstance(v, (list, tuple)) else float(v) for k, v in metrics.items()}
