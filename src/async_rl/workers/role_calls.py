"""A role's methods called on a worker group, written once for every role: how a call travels.

A trainer role (``ActorRole``, ``CriticRole``, ``SapoRole``) lists the methods the learner calls on it in
``REMOTE_CALLS`` (name -> :class:`RemoteCall`). The driver-side adapter (:func:`async_rl.workers.remote.remote_adapter`)
packs a call's arguments into one ``DataProto`` (:func:`pack_call`), pads it for data parallelism, and calls the
worker group's one generic method ``call_role`` (``TrainedRoleWorker.call_role``), which unpacks the arguments
(:func:`unpack_call`), checks them before any collective, runs the role's own method on its shard and packs the
result (:func:`pack_result`). So a role is written once and runs in process or on Ray; a new role method the
learner calls is one ``REMOTE_CALLS`` entry.

Packing: the ``batch`` argument's per-row tensors and lists become the DataProto's columns under their own names;
another argument that is a per-row tensor becomes the column ``arg__<name>``, a mapping's per-row entries
``arg__<name>__<key>`` (its other entries travel in ``meta_info``); every other argument (numbers, strings, None)
travels in ``meta_info["kwargs"]``. Arguments left out are not sent, so the role's own defaults apply.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

import numpy as np
import torch
from verl.protocol import DataProto

from async_rl.workers.proto import MODEL_INPUT_KEYS, object_array

ARG_PREFIX = "arg__"
RESULT_PREFIX = "out__"


@dataclasses.dataclass(frozen=True)
class RemoteCall:
    """How one role method runs over a worker group's data-parallel ranks.

    Attributes:
        required: batch columns every rank checks before any collective (a malformed call fails on every rank and
            leaves the group usable).
        trains: an optimizer step: a colocated rollout's KV cache is freed first, and the weights count as changed.
        global_metrics: metrics that are already global on every rank (a grad norm); the other metrics are
            rank-local shares and are summed over the ranks. Ignored with ``reduce_metrics=False``.
        reduce_metrics: False when the role all-reduces its own metrics.
        zero_keys: columns set to 0 in the rows added to pad the batch to the world size (masks, advantages), so
            that padding rows carry no loss weight.
    """

    required: tuple[str, ...] = MODEL_INPUT_KEYS
    trains: bool = False
    global_metrics: tuple[str, ...] = ()
    reduce_metrics: bool = True
    zero_keys: tuple[str, ...] = ("response_mask",)


def _rows(value: Any, bs: int) -> bool:
    if torch.is_tensor(value):
        return value.dim() > 0 and value.shape[0] == bs
    return isinstance(value, (list, tuple, np.ndarray)) and len(value) == bs


def _batch_size(arguments: Mapping[str, Any]) -> int:
    batch = arguments.get("batch")
    if not isinstance(batch, Mapping):
        raise TypeError(f"a remote role call needs a collated batch dict as `batch`, got {type(batch).__name__}")
    for value in batch.values():
        if torch.is_tensor(value) and value.dim() > 0:
            return int(value.shape[0])
    raise ValueError("the batch holds no per-row tensor")


def pack_call(method: str, arguments: Mapping[str, Any]) -> DataProto:
    """One call's arguments (bound by name; ``batch`` a collated dict) as a DataProto (module docstring)."""
    bs = _batch_size(arguments)
    tensors: dict[str, torch.Tensor] = {}
    non_tensors: dict[str, np.ndarray] = {}
    kwargs: dict[str, Any] = {}
    mappings: dict[str, dict[str, Any]] = {}

    def put(column: str, value: Any, owner: str) -> bool:
        if torch.is_tensor(value) and _rows(value, bs):
            tensors[column] = value
            return True
        if not torch.is_tensor(value) and _rows(value, bs):
            non_tensors[column] = object_array(list(value))
            return True
        return False

    for name, value in arguments.items():
        if name == "batch":
            for key, column in value.items():
                if not put(key, column, name):
                    raise ValueError(f"{method}: batch[{key!r}] is not one entry per row ({bs} rows)")
        elif isinstance(value, Mapping):
            mappings[name] = {key: item for key, item in value.items()
                              if not put(f"{ARG_PREFIX}{name}__{key}", item, name)}
        elif not put(f"{ARG_PREFIX}{name}", value, name):
            kwargs[name] = value
    meta = {"method": method, "kwargs": kwargs, "mappings": mappings}
    return DataProto.from_dict(tensors=tensors or None, non_tensors=non_tensors, meta_info=meta)


def unpack_call(data: DataProto) -> dict[str, Any]:
    """The inverse of :func:`pack_call` on one rank's shard: the role method's keyword arguments."""
    columns: dict[str, Any] = {}
    if data.batch is not None:
        columns.update({key: data.batch[key] for key in data.batch.keys()})
    columns.update({key: list(value) for key, value in data.non_tensor_batch.items()})
    arguments: dict[str, Any] = dict(data.meta_info.get("kwargs") or {})
    mappings = {name: dict(rest) for name, rest in (data.meta_info.get("mappings") or {}).items()}
    batch = {}
    for key, value in columns.items():
        if not key.startswith(ARG_PREFIX):
            batch[key] = value
            continue
        name, _, entry = key[len(ARG_PREFIX):].partition("__")
        if entry:
            mappings.setdefault(name, {})[entry] = value
        else:
            arguments[name] = value
    arguments.update(mappings)
    arguments["batch"] = batch
    return arguments


def pack_result(result: Any, metrics_reducer=None) -> DataProto:
    """A role method's result on one rank: a per-row tensor (``out``), a dict of per-row tensors (``out__<key>``),
    or metrics (a dict of numbers, in ``meta_info["metrics"]``, passed through ``metrics_reducer`` first)."""
    if torch.is_tensor(result):
        return DataProto.from_dict(tensors={"out": result})
    if isinstance(result, Mapping) and result and all(torch.is_tensor(v) and v.dim() > 0 for v in result.values()):
        return DataProto.from_dict(tensors={f"{RESULT_PREFIX}{key}": value for key, value in result.items()})
    if isinstance(result, Mapping):
        metrics = {key: float(value) for key, value in result.items()}
        if metrics_reducer is not None:
            metrics = metrics_reducer(metrics)
        return DataProto(batch=None, non_tensor_batch={}, meta_info={"metrics": metrics})
    raise TypeError(f"a remote role call returns a tensor, a dict of tensors or metrics, got {type(result).__name__}")


def unpack_result(data: DataProto) -> Any:
    """The inverse of :func:`pack_result` after the ranks' shards are joined (and the padding dropped)."""
    from async_rl.workers.proto import metrics_from_proto

    if data.batch is not None and "out" in data.batch.keys():
        return data.batch["out"]
    if data.batch is not None and any(key.startswith(RESULT_PREFIX) for key in data.batch.keys()):
        return {key[len(RESULT_PREFIX):]: data.batch[key] for key in data.batch.keys()}
    return metrics_from_proto(data)


def remote_call_of(role_class: type, method: str) -> RemoteCall:
    calls: Optional[Mapping[str, RemoteCall]] = getattr(role_class, "REMOTE_CALLS", None)
    if not calls or method not in calls:
        raise AttributeError(f"{role_class.__name__} has no remote method {method!r}; its REMOTE_CALLS: "
                             f"{sorted(calls or {})}")
    return calls[method]


__all__ = ["RemoteCall", "pack_call", "pack_result", "remote_call_of", "unpack_call", "unpack_result"]
