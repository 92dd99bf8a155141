"""A CPU checkpoint engine for verl's ``CheckpointEngineRegistry``: weights travel through the Ray object store.

Registers :class:`ObjectStoreCheckpointEngine` as ``"ray_object_store"`` (like verl's ``"nccl"``), so
``CheckpointEngineRegistry.new("ray_object_store")`` works on CPU and the GPU path keeps verl's engines unchanged.
Two uses: handed over by the driver (``ReplicaPool``'s own update: :meth:`send_weights` or
``ActorWorker.publish_weights`` give the handle, a receiver calls :meth:`set_source`, then iterates
:meth:`receive_weights`), or inside verl's ``CheckpointEngineManager``, where a :class:`WeightMailbox` actor
stands in for the process group.

Details: docs/rollout.md (7, "The CPU checkpoint engine"; 9, "The CPU transport").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Optional

import ray
import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

BACKEND_NAME = "ray_object_store"


def published_handle(version: int, ref: ray.ObjectRef) -> dict[str, Any]:
    """The handle format shared with ``ActorWorker.publish_weights``."""
    return {"version": int(version), "ref": [ref]}


def in_process_handle(version: int) -> dict[str, Any]:
    """What a publication sends to replicas that read the weights in memory (``rollout.mode=hybrid``): only the
    version; each replica takes its train rank's current weights."""
    return {"version": int(version), "in_process": True}


def check_published_handle(published: Any, version: Optional[int] = None) -> ray.ObjectRef:
    """Validate a published handle and return its ObjectRef; ``version`` (if given) must match."""
    if not (isinstance(published, Mapping) and "version" in published and "ref" in published):
        raise ValueError(f"expected a published weights handle {{'version': int, 'ref': [ObjectRef]}}, got "
                         f"{type(published).__name__}; publish with ActorWorker.publish_weights(v) or "
                         f"ObjectStoreCheckpointEngine.send_weights(...)")
    refs = published["ref"]
    if not (isinstance(refs, (list, tuple)) and len(refs) == 1 and isinstance(refs[0], ray.ObjectRef)):
        raise ValueError("published['ref'] must be a one-element list holding the ObjectRef of the state dict")
    if version is not None and int(published["version"]) != int(version):
        raise ValueError(f"the published weights are version {published['version']} but version {version} was "
                         f"requested; publish the version you announce")
    return refs[0]


class WeightMailbox:
    """The meeting point of manager-driven transfers (a Ray async actor, no CPU): the handle of the latest one.

    Each topology names a fresh transfer id, so a receiver never takes a handle left by an earlier transfer (a
    failed attempt, or another run whose sender is gone)."""

    def __init__(self) -> None:
        import asyncio

        self._transfer: Optional[str] = None
        self._handle: Optional[dict[str, Any]] = None
        self._posted = asyncio.Condition()

    async def ping(self) -> bool:
        return True

    async def post(self, transfer: str, handle: dict[str, Any]) -> None:
        async with self._posted:
            self._transfer, self._handle = transfer, handle  # the previous transfer's handle is dropped
            self._posted.notify_all()

    async def take(self, transfer: str, timeout_s: float) -> dict[str, Any]:
        """The handle posted for ``transfer``, waiting up to ``timeout_s`` for it."""
        import asyncio

        async with self._posted:
            try:
                await asyncio.wait_for(self._posted.wait_for(lambda: self._transfer == transfer), timeout=timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(f"no weights were posted for transfer {transfer} within {timeout_s:g} s; did "
                                   f"actor rank 0 run send_weights?") from None
            return self._handle


_MAILBOX_NAME = "async_rl_weight_mailbox_{}"


@CheckpointEngineRegistry.register(BACKEND_NAME)
class ObjectStoreCheckpointEngine(CheckpointEngine):
    """verl checkpoint engine whose transport is the Ray object store (CPU, one node or many).

    Args:
        bucket_size: accepted for signature compatibility with verl's engines (``CheckpointEngineWorker``
            passes ``update_weights_bucket_megabytes``); the object store needs no bucket.
        is_master: unused, as above.
    """

    _mailboxes: dict[str, Any] = {}  # created by build_topology in the manager's process, kept alive there

    def __init__(self, bucket_size: int = 0, is_master: bool = False, receive_timeout_s: float = 600.0) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.receive_timeout_s = float(receive_timeout_s)
        self.rank: Optional[int] = None
        self.num_senders = 0
        self._mailbox = None
        self._transfer: Optional[str] = None
        self._source: Optional[dict[str, Any]] = None

    def prepare(self) -> dict[str, Any]:
        # nothing to allocate or register: the object store owns the buffer
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Ranks 0..A-1 are the actor ranks (0 sends), A.. the rollout workers; all meet at one mailbox actor."""
        import os

        name = _MAILBOX_NAME.format(os.getpid())
        mailbox = cls._mailboxes.get(name)  # one per manager process, reused by every update; this handle keeps
        try:                                # it alive (ray.get_actor handles do not)
            if mailbox is None:
                raise ValueError("no mailbox yet")
            ray.get(mailbox.ping.remote(), timeout=30)
        except ray.exceptions.GetTimeoutError:
            pass  # alive but slow to answer (a loaded machine): the handle stays valid, its calls queue
        except Exception:  # none yet, or it belonged to an earlier Ray session (get_if_exists: never a second one)
            cls._mailboxes[name] = ray.remote(WeightMailbox).options(name=name, num_cpus=0,
                                                                      get_if_exists=True).remote()
        import uuid

        world = actor_wg_world_size + rollout_world_size
        transfer = uuid.uuid4().hex

        def kwargs(ranks: list[int]) -> dict[str, list[Any]]:
            n = len(ranks)
            return {"rank": ranks, "mailbox": [name] * n, "transfer": [transfer] * n,
                    "num_senders": [actor_wg_world_size] * n}
        return kwargs(list(range(actor_wg_world_size))), kwargs(list(range(actor_wg_world_size, world)))

    def init_process_group(self, rank: int = 0, mailbox: Optional[str] = None, transfer: Optional[str] = None,
                           num_senders: int = 0, **kwargs) -> None:
        self.rank = int(rank)
        self.num_senders = int(num_senders)
        self._transfer = transfer
        self._mailbox = ray.get_actor(mailbox) if mailbox else None

    def finalize(self) -> None:
        # drop our reference so the object store can free the old version once every replica loaded it
        self._source = None
        self._mailbox = None

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                           global_steps: int | None = None) -> dict[str, Any]:
        """Put one CPU state dict in the object store; returns the published handle for the receivers (and, inside
        verl's manager, posts it to the mailbox). Actor ranks other than 0 only walk the generator."""
        items = weights.items() if isinstance(weights, Mapping) else weights
        if self._mailbox is not None and self.rank != 0:
            for _ in items:  # each weight may be a collective over the actor ranks: take part, send nothing
                pass
            return {}
        state = {name: tensor.detach().to("cpu").contiguous() for name, tensor in items}
        handle = published_handle(0 if global_steps is None else global_steps, ray.put(state))
        self._source = handle
        if self._mailbox is not None:
            await self._mailbox.post.remote(self._transfer, handle)
        return handle

    def set_source(self, published: dict[str, Any]) -> None:
        """Receiver side: which published handle the next :meth:`receive_weights` reads."""
        check_published_handle(published)
        self._source = published

    def receive_weights(self, global_steps: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` from the published state dict (a zero-copy view of shared memory)."""
        if self._source is None and self._mailbox is not None:  # inside verl's manager: wait for rank 0's post
            self._source = ray.get(self._mailbox.take.remote(self._transfer, self.receive_timeout_s))
        if self._source is None:
            raise RuntimeError("receive_weights() before set_source(published): nothing was published")
        ref = check_published_handle(self._source, global_steps)
        state = ray.get(ref)
        if not isinstance(state, Mapping):
            raise ValueError(f"the published object is a {type(state).__name__}, not a state dict")
        yield from state.items()
