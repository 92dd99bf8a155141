"""The actor and critic roles as verl workers, one per data-parallel rank (``ActorWorker``, ``CriticWorker``).

The computation is :class:`async_rl.workers.roles.ActorRole` / :class:`~async_rl.workers.roles.CriticRole`; a worker
adds the process group, the ``@register`` dispatch modes and the ``DataProto`` conversion.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import ray
import torch
from verl.protocol import DataProto
from verl.single_controller.base.decorator import Dispatch, register

from async_rl.engine import dist
from async_rl.engine.base import OptimizerConfig
from async_rl.engine.settings import TrainingSettings
from async_rl.workers.proto import ACTOR_UPDATE_KEYS, CRITIC_UPDATE_KEYS, MODEL_INPUT_KEYS, check_keys, proto_to_batch
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

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_probs(self, data: DataProto) -> DataProto:
        """``log_probs (bs, T)``: log π_θ of this shard's response tokens (the rollout's rule)."""
        self._require_model()
        check_keys(data, MODEL_INPUT_KEYS, "compute_log_probs")
        log_probs = self.role.log_probs(proto_to_batch(data))
        return DataProto.from_dict(tensors={"log_probs": log_probs})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        """One optimizer step on this rank's shard; the token-mean normaliser is global.

        ``data.batch`` needs :data:`ACTOR_UPDATE_KEYS` (``advantages (bs, T)`` included);
        ``data.meta_info`` may set ``loss_mode`` ("ppo_clip" | "dis" | "dis_clip" | "vanilla"), ``clip_low``,
        ``clip_high``, ``dis_low``, ``dis_high``, ``loss_agg_mode``. Returns an empty DataProto with the global metrics in
        ``meta_info["metrics"]``.
        """
        self._require_model()
        check_keys(data, ACTOR_UPDATE_KEYS, "update_actor")
        self._free_colocated_rollout_cache()
        meta = data.meta_info
        batch = proto_to_batch(data)
        advantages = batch.pop("advantages")
        # RemoteActor.update always sends every setting: the role's defaults apply only to keys it left out
        settings = {key: meta[key] for key in ("clip_low", "clip_high", "dis_low", "dis_high", "loss_agg_mode")
                    if key in meta}
        metrics = self.role.update(batch, advantages, meta.get("loss_mode", "ppo_clip"), **settings)
        self.update_count += 1
        metrics = _reduce_metrics(metrics, self.role.engine.device, keep=("actor/grad_norm",))
        return DataProto(batch=None, non_tensor_batch={}, meta_info={"metrics": metrics})

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

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        """``values (bs, T)``: V(s_t) before every response token (0 off real response tokens)."""
        self._require_model()
        check_keys(data, MODEL_INPUT_KEYS, "compute_values")
        return DataProto.from_dict(tensors={"values": self.role.values(proto_to_batch(data))})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        """One optimizer step of the clipped value loss (the caller drives the K passes).

        ``data.batch`` needs :data:`CRITIC_UPDATE_KEYS`; ``meta_info`` may set ``clip_eps`` and
        ``ranking = {"margin", "coef"}`` (then ``batch["scores"]`` and ``non_tensor_batch["group_ids"]``
        are used). Under DP the ranking term is Eq. 11 over the global batch (the role all-gathers the
        terminal values, so groups may straddle ranks and pair counts may differ between them).
        """
        self._require_model()
        check_keys(data, CRITIC_UPDATE_KEYS, "update_critic")
        self._free_colocated_rollout_cache()
        meta = data.meta_info
        batch = proto_to_batch(data)
        ranking = None
        if meta.get("ranking") is not None:
            if "scores" not in batch or "group_ids" not in batch:
                raise KeyError("update_critic: ranking needs batch['scores'] and non_tensor_batch['group_ids']")
            ranking = {"scores": batch["scores"], "group_ids": list(batch["group_ids"]),
                       "margin": meta["ranking"]["margin"],
                       "coef": float(meta["ranking"]["coef"])}
        metrics = self.role.update(batch, batch["value_targets"], batch["value_mask"], batch["old_values"],
                                   clip_eps=meta.get("clip_eps", 0.2), ranking=ranking)
        metrics = _reduce_metrics(metrics, self.role.engine.device, keep=("critic/grad_norm", "li2sao/rank_loss"))
        return DataProto(batch=None, non_tensor_batch={}, meta_info={"metrics": metrics})
