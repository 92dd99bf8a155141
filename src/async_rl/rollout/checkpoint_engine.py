"""A CPU checkpoint engine for verl's ``CheckpointEngineRegistry``: weights travel through the Ray object store.

verl 0.9.1 moves weights from the trainer to the rollout replicas through a *checkpoint engine*
(``verl.checkpoint_engine.base.CheckpointEngine``): NCCL, NIXL, Mooncake, ... all need an accelerator or an
RDMA fabric. On a CPU machine (and between processes that share a node) the Ray object store already is
the transport: the sender ``ray.put``s one state dict, every receiver maps it from shared memory. This
module registers that transport under the name ``"ray_object_store"`` the same way verl registers its own
engines (``@CheckpointEngineRegistry.register``), so ``CheckpointEngineRegistry.new("ray_object_store")``
works and the GPU path can keep using verl's ``"nccl"`` engine unchanged.

There is no process group to build: :meth:`build_topology` only numbers the workers, and the
"connection" is the published handle ``{"version": v, "ref": [ObjectRef]}`` (the ref is wrapped in a list
so Ray does not resolve it while the handle is passed around). The trainer side calls
:meth:`send_weights` (or reuses ``ActorWorker.publish_weights``, which returns the same handle); a
receiver calls :meth:`set_source` with the handle, then iterates :meth:`receive_weights`.
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


@CheckpointEngineRegistry.register(BACKEND_NAME)
class ObjectStoreCheckpointEngine(CheckpointEngine):
    """verl checkpoint engine whose transport is the Ray object store (CPU, one node or many).

    Args:
        bucket_size: accepted for signature compatibility with verl's engines (``CheckpointEngineWorker``
            passes ``update_weights_bucket_megabytes``); the object store needs no bucket.
        is_master: unused, as above.
    """

    def __init__(self, bucket_size: int = 0, is_master: bool = False) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.rank: Optional[int] = None
        self._source: Optional[dict[str, Any]] = None

    def prepare(self) -> dict[str, Any]:
        # nothing to allocate or register: the object store owns the buffer
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        world = actor_wg_world_size + rollout_world_size
        return ({"rank": list(range(actor_wg_world_size))},
                {"rank": list(range(actor_wg_world_size, world))})

    def init_process_group(self, rank: int = 0, **kwargs) -> None:
        self.rank = int(rank)

    def finalize(self) -> None:
        # drop our reference so the object store can free the old version once every replica loaded it
        self._source = None

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                           global_steps: int | None = None) -> dict[str, Any]:
        """Put one CPU state dict in the object store; returns the published handle for the receivers."""
        items = weights.items() if isinstance(weights, Mapping) else weights
        state = {name: tensor.detach().to("cpu").contiguous() for name, tensor in items}
        handle = published_handle(0 if global_steps is None else global_steps, ray.put(state))
        self._source = handle
        return handle

    def set_source(self, published: dict[str, Any]) -> None:
        """Receiver side: which published handle the next :meth:`receive_weights` reads."""
        check_published_handle(published)
        self._source = published

    def receive_weights(self, global_steps: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` from the published state dict (a zero-copy view of shared memory)."""
        if self._source is None:
            raise RuntimeError("receive_weights() before set_source(published): nothing was published")
        ref = check_published_handle(self._source, global_steps)
        state = ray.get(ref)
        if not isinstance(state, Mapping):
            raise ValueError(f"the published object is a {type(state).__name__}, not a state dict")
        yield from state.items()
