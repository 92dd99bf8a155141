"""The driver's batch dict as a verl ``DataProto`` and back, and zero-weight padding for data parallelism.

Tensors travel in ``.batch``, per-row python objects in ``.non_tensor_batch``, settings and metrics in
``.meta_info``. Under DP every rank must get the same number of rows, so :func:`pad_proto_for_dp` adds
**zero-weight rows** (unlike verl's auto-padding, which repeats real rows and would change a training step) and
:func:`unpad` drops them from the outputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np
import torch
from verl.protocol import DataProto



# keys the worker methods read from ``DataProto.batch``
MODEL_INPUT_KEYS = ("prompts", "prompt_mask", "responses", "response_attention")
ACTOR_UPDATE_KEYS = MODEL_INPUT_KEYS + ("response_mask", "behaviour_log_probs", "advantages")
CRITIC_UPDATE_KEYS = MODEL_INPUT_KEYS + ("value_targets", "value_mask", "old_values")
# keys set to 0 on the rows added by :func:`pad_proto_for_dp` (they carry no loss weight)
ZERO_WEIGHT_KEYS = ("response_mask", "advantages", "value_mask")


SAPO_TURN_KEYS = ("turn_rewards", "turn_dones", "turn_mask", "turn_invalid")


def object_array(values: Sequence[Any]) -> np.ndarray:
    """A 1-D object array (``np.array`` would build a 2-D array from equal-length lists)."""
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def batch_to_proto(batch: Mapping[str, Any], meta_info: Optional[Mapping[str, Any]] = None) -> DataProto:
    """A collated batch dict as a verl ``DataProto``.

    Tensors whose first dimension is the batch size go to ``.batch``; per-row python values (a list,
    tuple or numpy array of batch-size length, e.g. ``group_ids``) to ``.non_tensor_batch`` as 1-D object
    arrays; anything else (scalars, settings, tensors of another length) to ``.meta_info``.
    The batch size is the first dimension of the first tensor (else the length of the first list).
    """
    bs = next((int(v.shape[0]) for v in batch.values() if torch.is_tensor(v) and v.dim() > 0), None)
    if bs is None:
        bs = next((len(v) for v in batch.values() if isinstance(v, (list, tuple, np.ndarray))), None)
    tensors, non_tensors, meta = {}, {}, dict(meta_info or {})
    for key, value in batch.items():
        if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == bs:
            tensors[key] = value
        elif isinstance(value, (list, tuple, np.ndarray)) and not torch.is_tensor(value) and len(value) == bs:
            non_tensors[key] = object_array(list(value))
        else:
            meta[key] = value
    return DataProto.from_dict(tensors=tensors or None, non_tensors=non_tensors, meta_info=meta)


def proto_to_batch(proto: DataProto) -> dict[str, Any]:
    """The inverse of :func:`batch_to_proto` for the per-row data: tensors as tensors, non-tensor
    columns as python lists (``meta_info`` stays on the proto)."""
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
        extra = [f"__dp_pad_{i}__" for i in range(pad)] if key == "group_ids" else [value[-1]] * pad
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
