"""The actor and critic roles as verl workers, one per data-parallel rank (``ActorWorker``, ``CriticWorker``).

The computation is :class:`async_rl.workers.roles.ActorRole` / :class:`~async_rl.workers.roles.CriticRole`; a worker
adds the process group, the model's construction, and one generic data-parallel method, ``call_role``, that runs
any of the role's ``REMOTE_CALLS`` (``workers/role_calls.py``); the checkpoint and weight calls are ONE_TO_ALL.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Optional

import ray
import torch
from verl.protocol import DataProto
from verl.single_controller.base.decorator import Dispatch, register

from async_rl.engine import dist
from async_rl.engine.base import OptimizerConfig
from async_rl.engine.settings import TrainingSettings
from async_rl.workers.proto import check_keys
from async_rl.workers.role_calls import ARG_PREFIX, pack_result, remote_call_of, unpack_call
from async_rl.workers.worker_base import RoleWorker


def _reduce_metrics(metrics: dict[str, float], device: torch.device, *, keep: Sequence[str] = (),
                    average: Sequence[str] = ()) -> dict[str, float]:
    """Sum rank-local metric shares over the group (every rank then holds the global value).
    ``keep``: already global (e.g. grad norm); ``average``: per-rank means, averaged."""
    world = dist.get_world_size()
    if world == 1:
        return dict(metrics)
    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce_sum(values)
    out = {}
    for key, total in zip(keys, values.tolist()):
        if key in keep:
            out[key] = float(metrics[key])
        elif key in average:
            out[key] = total / world
        else:
            out[key] = total
    return out


def _checkpoint(engine) -> tuple[dict, Optional[dict]]:
    """Full model and optimizer state (rank 0; collectives on every rank).

    A fresh optimizer (no step yet) is saved as ``None``: torch's ``get_optimizer_state_dict`` would
    first initialise the empty AdamW state with a zero-gradient ``step()``, which advances the step
    counter and changes the bias correction of the next real update (the saved run would no longer
    match an unsaved one). The emptiness test is the same on every rank (all ranks step together).
    """
    model = engine.full_state_dict(rank0_only=True)
    optim = engine.optimizer_state_dict(rank0_only=True) if engine.optimizer.state else None
    return model, optim


class TrainedRoleWorker(RoleWorker):
    """What every trained role's worker shares, written once: the optimizer-step counter a colocated rollout
    checks, and the four checkpoint calls (full state through rank 0, sharded state on every rank). A subclass
    sets ``self.role`` (an object with an ``engine``) in ``init_model``. Loading weights frees a colocated
    rollout's KV cache first and counts as a weight change (a colocated rollout must sync again)."""

    def __init__(self, *, torch_threads: Optional[int] = 1, device: Optional[str] = None,
                 dist_timeout_s: float = 600.0):
        super().__init__(torch_threads=torch_threads, device=device, dist_timeout_s=dist_timeout_s)
        self.role = None
        # weight changes: the actor's optimizer steps and every load (a colocated rollout checks it synced since)
        self.update_count = 0

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def call_role(self, data: DataProto) -> DataProto:
        """Run one of the role's ``REMOTE_CALLS`` on this rank's shard: the one worker method behind every learner
        call (``workers/role_calls.py`` packs and unpacks; ``workers/remote.py`` is the driver's side).

        The inputs are checked first, identically on every rank, so a malformed call fails everywhere before any
        collective and leaves the group usable. A training call frees a colocated rollout's KV cache first and
        counts as a weight change; its metrics are summed over the ranks (but for the ones already global)."""
        self._require_model()
        method = str(data.meta_info.get("method"))
        call = remote_call_of(type(self.role), method)
        where = f"{type(self.role).__name__}.{method}"
        have = set(data.batch.keys()) if data.batch is not None else set()
        missing = [key.replace(ARG_PREFIX, "argument ") for key in call.required if key not in have]
        if missing:
            raise KeyError(f"{where}: the call is missing {missing} (it sent {sorted(have)})")
        check_keys(data, call.required, where)
        arguments = unpack_call(data)
        try:
            inspect.signature(getattr(self.role, method)).bind(**arguments)
        except TypeError as error:
            raise TypeError(f"{where}: {error}") from None
        if call.trains:
            self._free_colocated_rollout_cache()
        result = getattr(self.role, method)(**arguments)
        if call.trains:
            self.update_count += 1
        device = self.role.engine.device
        reducer = (lambda m: _reduce_metrics(m, device, keep=call.global_metrics)) if call.reduce_metrics else None
        return pack_result(result, reducer)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def state_dict(self) -> Optional[dict[str, Any]]:
        """Rank 0: ``{"model", "optim", "update_count"}`` (full, world-size independent); others None."""
        self._require_model()
        model, optim = _checkpoint(self.role.engine)
        return {"model": model, "optim": optim, "update_count": self.update_count} if self.rank == 0 else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Load a :meth:`state_dict` (saved at any world size); ``optim`` is optional."""
        self._require_model()
        self._free_colocated_rollout_cache()
        self.role.engine.load_full_state_dict(state["model"])
        if state.get("optim") is not None:
            self.role.engine.load_optimizer_state_dict(state["optim"])
        self.update_count = int(state.get("update_count", self.update_count)) + 1  # weights changed
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_sharded(self, directory: str) -> dict[str, Any]:
        """Every rank writes its shard of model + AdamW state under ``directory`` (one file system all
        ranks see); nothing is gathered. Returns the engine's metadata (world size, optimizer state)."""
        self._require_model()
        return self.role.engine.save_sharded(directory)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_sharded(self, directory: str) -> dict[str, Any]:
        """Load :meth:`save_sharded`'s shards, saved at this or another world size (DCP reshards)."""
        self._require_model()
        self._free_colocated_rollout_cache()
        meta = self.role.engine.load_sharded(directory)
        self.update_count += 1  # weights changed: a colocated rollout must sync again
        return meta


class ActorWorker(TrainedRoleWorker):
    """The policy on one data-parallel rank (FSDP2 over the worker group's ranks)."""

    def __init__(self, model_path: str, optim: Optional[OptimizerConfig] = None, temperature: float = 1.0,
                 banned_token_ids: Sequence[int] = (), micro_batch_size: Optional[int] = None,
                 training: Optional[TrainingSettings] = None,
                 dtype: Optional[str] = None, torch_threads: Optional[int] = 1, device: Optional[str] = None,
                 dist_timeout_s: float = 600.0):
        super().__init__(torch_threads=torch_threads, device=device, dist_timeout_s=dist_timeout_s)
        self.model_path = str(model_path)
        self.optim = optim or OptimizerConfig()
        self.temperature = temperature
        self.banned_token_ids = tuple(banned_token_ids)
        self.micro_batch_size = micro_batch_size
        self.training = (training or TrainingSettings()).validate()  # precision, token budget, checkpointing
        self.dtype = dtype
        self.checkpoint_engine = None  # verl checkpoint engine (init_checkpoint_engine), for CheckpointEngineManager

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        from async_rl.models.loading import load_causal_lm
        from async_rl.workers.roles import ActorRole

        ctx = self._init_distributed()
        model = load_causal_lm(self.model_path, dtype=self.dtype, device="cpu", **self.training.model_kwargs())
        self.role = ActorRole(model, self.optim, temperature=self.temperature,
                              banned_token_ids=self.banned_token_ids, micro_batch_size=self.micro_batch_size,
                              **self.training.role_kwargs())
        return {"rank": ctx.rank, "world_size": ctx.world_size, "backend": ctx.backend,
                "device": str(self.role.engine.device), "sharded": self.role.engine.is_sharded}

    def _full_weights_rank0(self) -> Optional[dict[str, torch.Tensor]]:
        self._require_model()
        sd = self.role.engine.full_state_dict(rank0_only=True)  # a collective: every rank calls it
        return sd if self.rank == 0 else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_weights(self) -> Optional[dict[str, torch.Tensor]]:
        """Rank 0: the full CPU state dict (every rank must call: it all-gathers); others ``None``."""
        return self._full_weights_rank0()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def publish_weights(self, version: int) -> Optional[dict[str, Any]]:
        """Rank 0 puts the full state dict in the Ray object store and returns
        ``{"version": version, "ref": [ObjectRef]}`` (the ref wrapped in a list so that Ray does not
        resolve it on the way); the driver hands the ref to the rollout workers, which fetch the
        weights from the object store themselves. Other ranks return ``None``."""
        sd = self._full_weights_rank0()
        if sd is None:
            return None
        return {"version": int(version), "ref": [ray.put(sd)]}

    # ------------------------------------------------ verl's checkpoint-engine worker methods (docs/rollout.md §9)
    # verl.checkpoint_engine.base.CheckpointEngineManager drives the actor group through exactly these three
    # (the names and dispatch modes of verl's own ActorRolloutRefWorker), so verl's NCCL engine -- or our object
    # store engine on CPU -- moves the weights from the train ranks straight into the rollout replicas.

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_checkpoint_engine(self, backend: str, bucket_megabytes: int = 2048,
                               engine_kwargs: Optional[dict[str, Any]] = None,
                               custom_backend_module: Optional[str] = None) -> str:
        """Create this rank's sender of ``backend`` (verl's ``CheckpointEngineRegistry``; rank 0 is the master)."""
        from verl.checkpoint_engine.base import CheckpointEngineRegistry
        from verl.utils.import_utils import import_external_libs

        import async_rl.rollout.checkpoint_engine  # noqa: F401  registers "ray_object_store"

        import_external_libs(custom_backend_module or None)
        self.checkpoint_engine = CheckpointEngineRegistry.new(backend, is_master=self.rank == 0,
                                                              bucket_size=int(bucket_megabytes) << 20,
                                                              **(engine_kwargs or {}))
        return type(self.checkpoint_engine).__name__

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        if getattr(self, "checkpoint_engine", None) is None:
            raise RuntimeError(f"actor rank {self.rank}: call init_checkpoint_engine(backend) first")
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def update_weights(self, global_steps: Optional[int] = None, mode: str = "auto") -> dict[str, Any]:
        """Send the current full weights through the checkpoint engine (every rank: gathering them is collective).

        ``mode``: the backend name or ``"auto"``; verl's ``"naive"`` (an engine inside this process) is served by
        ``rollout.mode=hybrid`` instead (``RolloutWorker.hybrid_wake_up``). Synchronous: the fused worker cannot
        await, so the engine's coroutine runs to completion here."""
        import asyncio

        self._require_model()
        if mode == "naive":
            raise ValueError("update_weights(mode='naive'): an engine inside the train ranks is rollout.mode=hybrid, "
                             "which syncs in memory (RolloutWorker.hybrid_wake_up); use a transfer backend here")
        if getattr(self, "checkpoint_engine", None) is None:
            raise RuntimeError(f"actor rank {self.rank}: call init_checkpoint_engine(backend) first")
        weights = self.role.engine.full_state_dict()  # all-gathered on every rank (FSDP), HF parameter names
        result = asyncio.run(self.checkpoint_engine.send_weights(iter(weights.items()), global_steps=global_steps))
        return {} if not isinstance(result, dict) or "ref" in result else result


class CriticWorker(TrainedRoleWorker):
    """The critic (policy backbone + value head, attention frozen) on one data-parallel rank."""

    def __init__(self, model_path: str, optim: Optional[OptimizerConfig] = None, freeze_attention: bool = True,
                 micro_batch_size: Optional[int] = None, training: Optional[TrainingSettings] = None,
                 dtype: Optional[str] = None,
                 torch_threads: Optional[int] = 1, device: Optional[str] = None, dist_timeout_s: float = 600.0):
        super().__init__(torch_threads=torch_threads, device=device, dist_timeout_s=dist_timeout_s)
        self.model_path = str(model_path)
        self.optim = optim or OptimizerConfig()
        self.freeze_attention = freeze_attention
        self.micro_batch_size = micro_batch_size
        self.training = (training or TrainingSettings()).validate()  # precision, token budget, checkpointing
        self.dtype = dtype

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        from async_rl.models.loading import load_causal_lm
        from async_rl.workers.roles import CriticRole

        ctx = self._init_distributed()  # idempotent when the actor shares this process
        model = load_causal_lm(self.model_path, dtype=self.dtype, device="cpu", **self.training.model_kwargs())
        self.role = CriticRole(model, self.optim, freeze_attention=self.freeze_attention,
                               micro_batch_size=self.micro_batch_size, **self.training.role_kwargs())
        return {"rank": ctx.rank, "world_size": ctx.world_size, "backend": ctx.backend,
                "device": str(self.role.engine.device), "sharded": self.role.engine.is_sharded}
