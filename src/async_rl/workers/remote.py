"""Driver-side adapters: the learner calls a worker group as it calls a local role.

One adapter, written once: :func:`remote_adapter` turns a role class into a class with the same methods for the
role's ``REMOTE_CALLS`` (``RemoteActor`` from ``ActorRole``, ``RemoteCritic`` from ``CriticRole``, ``RemoteSapo``
from ``SapoRole``). Each method binds its arguments to the role method's own signature, packs them into one
``DataProto`` (``workers/role_calls.py``), pads it to the world size with zero-weight rows, calls the group's
generic ``call_role`` and returns the result with the padding dropped, in batch order. :class:`RemoteRole` adds the
checkpoint calls (full state through rank 0, or every rank its shard) and the weight export.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from typing import Any, Optional

import ray
import torch
from verl.protocol import DataProto

from async_rl.algos.sapo import num_turns_of
from async_rl.workers.proto import pad_proto_for_dp, proto_to_batch, unpad
from async_rl.workers.role_calls import pack_call, remote_call_of, unpack_result
from async_rl.workers.roles import ActorRole, CriticRole
from async_rl.workers.sapo import SapoRole


def _first(values):
    return values[0] if isinstance(values, list) else values


class RemoteRole:
    """What every driver-side adapter shares, written once: the worker group, the call timeout, the generic
    data-parallel call, and the checkpoint calls of a :class:`~async_rl.workers.train_workers.TrainedRoleWorker`
    group (the driver's checkpoints use the sharded form, ``saves_sharded``)."""

    saves_sharded = True
    role_class: type = object  # set by remote_adapter

    def __init__(self, worker_group, timeout_s: Optional[float] = None):
        self.wg = worker_group
        self.timeout_s = timeout_s

    def _kw(self, timeout_s):
        t = self.timeout_s if timeout_s is None else timeout_s
        return {} if t is None else {"timeout_s": t}

    @property
    def world_size(self) -> int:
        return int(self.wg.world_size)

    def call(self, method: str, arguments: dict[str, Any], timeout_s: Optional[float] = None) -> Any:
        """Run ``role_class.method(**arguments)`` on every rank's share of the batch (``REMOTE_CALLS[method]``)."""
        spec = remote_call_of(self.role_class, method)
        if isinstance(arguments.get("batch"), DataProto):
            arguments = {**arguments, "batch": proto_to_batch(arguments["batch"])}
        padded, added = pad_proto_for_dp(pack_call(method, arguments), self.world_size, zero_keys=spec.zero_keys)
        return unpack_result(unpad(self.wg.call_role(padded, **self._kw(timeout_s)), added))

    def state_dict(self, timeout_s: Optional[float] = None) -> dict[str, Any]:
        return _first(self.wg.state_dict(**self._kw(timeout_s)))

    def load_state_dict(self, state: dict[str, Any], timeout_s: Optional[float] = None) -> None:
        self.wg.load_state_dict(ray.put(state), **self._kw(timeout_s))

    def save_sharded(self, directory, timeout_s: Optional[float] = None) -> dict[str, Any]:
        return _first(self.wg.save_sharded(os.fspath(directory), **self._kw(timeout_s)))

    def load_sharded(self, directory, timeout_s: Optional[float] = None) -> dict[str, Any]:
        return _first(self.wg.load_sharded(os.fspath(directory), **self._kw(timeout_s)))


class _WeightCalls:
    """The weight calls of a policy's worker group (``ActorWorker`` and ``SapoWorker``, ONE_TO_ALL)."""

    def export_weights(self, timeout_s: Optional[float] = None) -> dict[str, torch.Tensor]:
        """Full CPU weights (rank 0's; every rank takes part in the all-gather)."""
        return _first(self.wg.export_weights(**self._kw(timeout_s)))

    def publish_weights(self, version: int, timeout_s: Optional[float] = None) -> dict[str, Any]:
        """Rank 0 puts the full weights in Ray's object store: ``{"version", "ref": [ObjectRef]}``."""
        return _first(self.wg.publish_weights(version, **self._kw(timeout_s)))


def _remote_method(role_class: type, name: str):
    role_method = getattr(role_class, name)
    signature = inspect.signature(role_method)

    def method(self, *args, timeout_s: Optional[float] = None, **kwargs):
        bound = signature.bind(self, *args, **kwargs)  # the role's own signature: its defaults stay its own
        arguments = {key: value for key, value in bound.arguments.items() if key != "self"}
        return self.call(name, arguments, timeout_s)

    method.__name__ = name
    method.__doc__ = f"``{role_class.__name__}.{name}`` on the worker group's ranks.\n\n{role_method.__doc__ or ''}"
    timeout = inspect.Parameter("timeout_s", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="Optional[float]")
    method.__signature__ = signature.replace(parameters=[*signature.parameters.values(), timeout])
    return method


def remote_adapter(role_class: type, name: Optional[str] = None) -> type:
    """A :class:`RemoteRole` subclass with one method per ``role_class.REMOTE_CALLS`` entry (same signature, plus
    ``timeout_s``), and the weight calls when the role exports weights."""
    bases = (RemoteRole, _WeightCalls) if hasattr(role_class, "export_weights") else (RemoteRole,)
    namespace = {method: _remote_method(role_class, method) for method in role_class.REMOTE_CALLS}
    name = name or f"Remote{role_class.__name__.removesuffix('Role')}"
    for method in namespace.values():
        method.__qualname__ = f"{name}.{method.__name__}"
    namespace.update(role_class=role_class, __module__=__name__,
                     __doc__=f"The :class:`{role_class.__name__}` calls the learner makes, served by a worker group.")
    return type(name, bases, namespace)


RemoteActor = remote_adapter(ActorRole, "RemoteActor")
RemoteCritic = remote_adapter(CriticRole, "RemoteCritic")


class RemoteSapo(remote_adapter(SapoRole, "_RemoteSapoCalls")):
    """The :class:`~async_rl.workers.sapo.SapoRole` calls (spec §5) on a ``SapoWorker`` group, and the reserved value
    ids the rollout must never sample (``banned_token_ids``), as the workers resolved them."""

    def __init__(self, worker_group, reserved_ids: Sequence[int], timeout_s: Optional[float] = None):
        if len(tuple(reserved_ids)) != 2:
            raise ValueError(f"RemoteSapo needs the two reserved value ids (w+, w-), got {tuple(reserved_ids)}")
        super().__init__(worker_group, timeout_s)
        self.reserved_ids = tuple(int(i) for i in reserved_ids)

    @property
    def banned_token_ids(self) -> tuple[int, int]:
        """The rollout never samples the reserved ids (their logits are the V/Q readout)."""
        return self.reserved_ids

    def readouts(self, batch, num_turns: Optional[int] = None, timeout_s: Optional[float] = None
                 ) -> dict[str, torch.Tensor]:
        """``SapoRole.readouts`` on the ranks, with K taken from the whole batch when not given: a rank's shard may
        hold fewer turns, and the shards' readouts are joined again."""
        if num_turns is None:
            num_turns = num_turns_of(batch["token_turn_index"])
        return self.call("readouts", {"batch": batch, "num_turns": int(num_turns)}, timeout_s)


__all__ = ["RemoteActor", "RemoteCritic", "RemoteRole", "RemoteSapo", "remote_adapter"]
