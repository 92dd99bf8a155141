"""The actor, critic and rollout roles as verl ``single_controller`` workers (Ray actors).

Each worker is a thin wrapper: the computation lives in :class:`async_rl.workers.roles.ActorRole`,
:class:`async_rl.workers.roles.CriticRole` and :class:`async_rl.rollout.hf_engine.HFRolloutEngine`;
the worker adds the process group, the ``@register`` dispatch modes and the :class:`DataProto`
conversion. Placement (which process holds which worker) is in :mod:`async_rl.workers.placement`;
the picture is in ``docs/architecture.md``.

================  ===============================  ==============================================
worker            method                           dispatch (verl)
================  ===============================  ==============================================
ActorWorker       ``init_model()``                 ONE_TO_ALL: process group + FSDP actor
                  ``compute_log_probs(data)``      DP_COMPUTE_PROTO: one shard per rank
                  ``update_actor(data)``           DP_COMPUTE_PROTO: one optimizer step, global
                                                   token-mean (``engine.global_denominator``)
                  ``export_weights()``             ONE_TO_ALL: rank 0's full state dict
                  ``publish_weights(version)``     ONE_TO_ALL: rank 0 puts them in the object store
                  ``state_dict()`` /               ONE_TO_ALL: checkpoints (model + AdamW)
                  ``load_state_dict(state)``
                  ``save_sharded(dir)`` /          ONE_TO_ALL: every rank writes / reads its own
                  ``load_sharded(dir)``            shard (torch.distributed.checkpoint, reshards)
CriticWorker      ``init_model``, ``compute_values``, ``update_critic``, ``state_dict``,
                  ``load_state_dict``, ``save_sharded``, ``load_sharded`` (same modes)
RolloutWorker     ``init_model()``                 ONE_TO_ALL: an HFRolloutEngine per worker
                  ``generate(data)``               requests split over the workers (DataProto or
                                                   a list of request dicts), outputs concatenated
                  ``update_weights(sd_or_ref, v)`` ONE_TO_ALL: weights (or an ObjectRef) + version
                  ``sync_from_actor(version)``     ONE_TO_ALL: colocated only, no copy through Ray
================  ===============================  ==============================================

Every worker also has ``ping(sleep_s=0)`` (a health check).

**Data.** The driver's collated batch (:func:`async_rl.driver.trajectory.collate`) travels as a verl
``DataProto``: tensors in ``.batch``, per-row python objects in ``.non_tensor_batch``, settings and
metrics in ``.meta_info`` (:func:`batch_to_proto`, :func:`proto_to_batch`). Under DP every rank must
get the same number of rows (FSDP collectives run once per micro-batch, in lock-step), so the driver
helpers pad a batch to a multiple of the world size with **zero-weight rows**
(:func:`pad_proto_for_dp`) -- unlike verl's auto-padding, which repeats real rows and would change a
training step -- and drop the padded rows from the outputs.

**Bounded calls.** Worker groups built by :mod:`async_rl.workers.placement` are
:class:`TimedRayWorkerGroup` s: every registered method waits at most ``timeout_s`` (a per-call
keyword, else the group's ``call_timeout_s``). A worker that raises surfaces at the driver as a
:class:`WorkerCallError` naming the method, the worker and the cause, as soon as that worker fails
(not after the slowest rank); a call that does not finish in time raises :class:`WorkerTimeoutError`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np
import ray
import torch
from verl.protocol import DataProto, _padding_size_key
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayWorkerGroup

from async_rl.engine import dist
from async_rl.engine.base import OptimizerConfig
from async_rl.engine.settings import TrainingSettings

DEFAULT_CALL_TIMEOUT_S = 600.0

# keys the worker methods read from ``DataProto.batch``
MODEL_INPUT_KEYS = ("prompts", "prompt_mask", "responses", "response_attention")
ACTOR_UPDATE_KEYS = MODEL_INPUT_KEYS + ("response_mask", "behaviour_log_probs", "advantages")
CRITIC_UPDATE_KEYS = MODEL_INPUT_KEYS + ("value_targets", "value_mask", "old_values")
# keys set to 0 on the rows added by :func:`pad_proto_for_dp` (they carry no loss weight)
ZERO_WEIGHT_KEYS = ("response_mask", "advantages", "value_mask")


# ============================================================================ errors


class WorkerCallError(RuntimeError):
    """A worker method raised (or its worker died). ``worker``/``rank`` name the first failure."""

    def __init__(self, message: str, *, method: str, worker: Optional[str], rank: Optional[int],
                 cause: Optional[BaseException] = None):
        super().__init__(message)
        self.method = method
        self.worker = worker
        self.rank = rank
        self.cause = cause


class WorkerTimeoutError(WorkerCallError, TimeoutError):
    """A worker method did not finish within the call's timeout."""


def _original_cause(error: BaseException) -> BaseException:
    """The user exception inside a ``RayTaskError`` (else the error itself)."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


def _other_failures(pending, position, grace_s: float) -> list[int]:
    """Ranks among ``pending`` that fail within a short grace period (the usual case when every rank
    rejects the same bad input); reading them also keeps Ray from logging them as unhandled."""
    if not pending or grace_s <= 0:
        return []
    ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=grace_s)
    failed = []
    for ref in ready:
        try:
            ray.get(ref)
        except Exception:
            failed.append(position[ref])
    return sorted(failed)


def wait_for_workers(refs, *, method: str, worker_names: Sequence[str], timeout_s: float):
    """``ray.get`` with a deadline that fails fast.

    Waits for ``refs`` (one ObjectRef or a list, one per worker) and returns their values. The first
    worker that raises ends the wait at once with a :class:`WorkerCallError`, even while other ranks
    are still running (they may be blocked in a collective waiting for the failed rank). If the
    deadline passes first, :class:`WorkerTimeoutError` names the workers still running.
    """
    single = isinstance(refs, ray.ObjectRef)
    ref_list = [refs] if single else list(refs)
    position = {ref: i for i, ref in enumerate(ref_list)}
    n = len(ref_list)

    def name(i: int) -> str:
        return worker_names[i] if i < len(worker_names) else f"worker {i}"

    deadline = time.monotonic() + timeout_s
    pending = list(ref_list)
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            stuck = [position[r] for r in pending]
            raise WorkerTimeoutError(
                f"{method} did not finish within {timeout_s:g}s on {len(stuck)} of {n} workers: "
                f"{', '.join(f'{name(i)} (rank {i})' for i in stuck)}. The workers keep running; if they are "
                f"blocked (e.g. in a collective after another rank failed), shut the worker group down.",
                method=method, worker=name(stuck[0]), rank=stuck[0])
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as error:  # RayTaskError(cause), ActorDiedError, ...
                i = position[ref]
                cause = _original_cause(error)
                detail = str(cause).strip().splitlines()
                others = _other_failures(pending, position, grace_s=min(0.5, max(deadline - time.monotonic(), 0)))
                also = f" (also failed: {', '.join(f'rank {j}' for j in others)})" if others else ""
                raise WorkerCallError(
                    f"{method} failed on {name(i)} (rank {i} of {n}): {type(cause).__name__}: "
                    f"{detail[-1] if detail else ''}{also}",
                    method=method, worker=name(i), rank=i, cause=cause) from error
    values = ray.get(ref_list)
    return values[0] if single else values


# ============================================================================ worker group with timeouts


def _group_label(worker_group) -> str:
    """``actor`` for a role of a fused (colocated) group, else the worker class name."""
    if getattr(worker_group, "sub_cls_name", ""):
        return worker_group.sub_cls_name
    cls = getattr(getattr(worker_group, "ray_cls_with_init", None), "cls", None)
    name = type(cls).__name__ if cls is not None else type(worker_group).__name__
    if name.startswith("ActorClass(") and name.endswith(")"):
        name = name[len("ActorClass("):-1]
    return name


def _timed_func_generator(worker_group, method_name, dispatch_fn, collect_fn, execute_fn, blocking):
    """Like verl's ``func_generator`` (``verl/single_controller/ray/base.py``), but the wait for the
    workers has a deadline and failures name the worker. ``timeout_s=`` is reserved as a per-call
    keyword (it is not forwarded to the worker)."""

    class Functor:
        def __call__(this, *args, timeout_s: Optional[float] = None, **kwargs):
            try:
                args, kwargs = dispatch_fn(worker_group, *args, **kwargs)
            except Exception as error:
                raise ValueError(
                    f"{_group_label(worker_group)}.{method_name}: cannot dispatch the input over "
                    f"{worker_group.world_size} workers ({type(error).__name__}: {error}); DP methods need a "
                    f"DataProto whose length is a multiple of the world size (see pad_proto_for_dp)") from error
            padding_count = kwargs.pop(_padding_size_key, 0)
            output = execute_fn(method_name, *args, **kwargs)
            if blocking:
                timeout = worker_group.call_timeout_s if timeout_s is None else timeout_s
                label = f"{_group_label(worker_group)}.{method_name}"
                output = wait_for_workers(output, method=label, worker_names=worker_group.worker_names,
                                          timeout_s=timeout)
            output = collect_fn(worker_group, output)
            if padding_count > 0:
                if isinstance(output, DataProto):
                    output = output.select_idxs(list(range(len(output) - padding_count)))
                elif isinstance(output, list):
                    output = output[:-padding_count]
            return output

    return type(method_name, (Functor,), {})()


class TimedRayWorkerGroup(RayWorkerGroup):
    """A verl ``RayWorkerGroup`` whose bound methods never block without a deadline.

    ``call_timeout_s`` is the default per call; ``wg.method(..., timeout_s=30)`` overrides it.
    Everything else (resource pools, dispatch modes, fused/colocated groups, ``spawn``) is verl's.
    """

    def __init__(self, *args, call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S, **kwargs):
        self.call_timeout_s = float(call_timeout_s)
        super().__init__(*args, **kwargs)

    def _bind_worker_method(self, user_defined_cls, func_generator):
        # verl passes its own func_generator (plain ray.get); ours adds the deadline.
        if not hasattr(self, "call_timeout_s"):
            self.call_timeout_s = DEFAULT_CALL_TIMEOUT_S
        return super()._bind_worker_method(user_defined_cls, _timed_func_generator)

    def spawn(self, prefix_set):
        groups = super().spawn(prefix_set)
        for group in groups.values():
            group.call_timeout_s = self.call_timeout_s
        return groups


# ============================================================================ DataProto <-> batch dict


def _object_array(values: Sequence[Any]) -> np.ndarray:
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
            non_tensors[key] = _object_array(list(value))
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
        non_tensors[key] = _object_array(list(value) + extra)
    padded = DataProto.from_dict(tensors=tensors or None, non_tensors=non_tensors, meta_info=dict(proto.meta_info))
    return padded, pad


def _unpad(proto: DataProto, n_added: int) -> DataProto:
    return proto if n_added == 0 else proto.select_idxs(list(range(len(proto) - n_added)))


def _check_keys(proto: DataProto, required: Sequence[str], where: str) -> None:
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


# ============================================================================ workers


class _RoleWorker(Worker):
    """Shared plumbing: thread count, process group, health check."""

    def __init__(self, torch_threads: Optional[int] = 1, device: Optional[str] = None,
                 dist_timeout_s: float = 600.0):
        super().__init__()
        if torch_threads:
            torch.set_num_threads(int(torch_threads))
        self.device_type = device
        self.dist_timeout_s = dist_timeout_s
        self.dist_ctx: Optional[dist.DistContext] = None

    def _init_distributed(self) -> dist.DistContext:
        # verl's Worker put RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (one rendezvous per worker group)
        # in the environment; the backend follows the device (gloo on CPU, NCCL on CUDA).
        self.dist_ctx = dist.init_distributed(device=self.device_type, timeout_s=self.dist_timeout_s)
        return self.dist_ctx

    def _require_model(self):
        if getattr(self, "role", None) is None:
            raise RuntimeError(f"{type(self).__name__} rank {self.rank}: call init_model() first")

    def _sibling(self, role: str):
        """Another role fused into this process (colocated placement), else ``None``."""
        return (getattr(self, "fused_worker_dict", None) or {}).get(role)

    def _free_colocated_rollout_cache(self) -> None:
        """A training call is about to use this process's device: the fused rollout engine (colocated placement,
        ``rollout.mode=hybrid``) drops its KV cache; its requests keep their tokens and are re-prefilled when it
        runs again (verl's hybrid engine sleeps its rollout the same way around updates)."""
        engine = getattr(self._sibling("rollout"), "engine", None)
        if engine is not None:
            engine.release_cache()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ping(self, sleep_s: float = 0.0) -> dict[str, Any]:
        """Health check: who and where this worker is (``sleep_s`` delays the answer)."""
        if sleep_s:
            time.sleep(sleep_s)
        return {"class": type(self).__name__, "rank": self.rank, "world_size": self.world_size,
                "pid": os.getpid(), "device": str(dist.current_device()),
                "backend": self.dist_ctx.backend if self.dist_ctx else None,
                "torch_threads": torch.get_num_threads()}


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


class ActorWorker(_RoleWorker):
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
        self.role = None
        self.update_count = 0  # optimizer steps taken (a colocated rollout checks it was synced)
        self.checkpoint_engine = None  # verl checkpoint engine (init_checkpoint_engine), for CheckpointEngineManager

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        from async_rl.models.loading import load_causal_lm
        from async_rl.workers.roles import ActorRole

        ctx = self._init_distributed()
        model = load_causal_lm(self.model_path, dtype=self.dtype, device="cpu")
        self.role = ActorRole(model, self.optim, temperature=self.temperature,
                              banned_token_ids=self.banned_token_ids, micro_batch_size=self.micro_batch_size,
                              **self.training.role_kwargs())
        return {"rank": ctx.rank, "world_size": ctx.world_size, "backend": ctx.backend,
                "device": str(self.role.engine.device), "sharded": self.role.engine.is_sharded}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_probs(self, data: DataProto) -> DataProto:
        """``log_probs (bs, T)``: log π_θ of this shard's response tokens (the rollout's rule)."""
        self._require_model()
        _check_keys(data, MODEL_INPUT_KEYS, "compute_log_probs")
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
        _check_keys(data, ACTOR_UPDATE_KEYS, "update_actor")
        self._free_colocated_rollout_cache()
        meta = data.meta_info
        batch = proto_to_batch(data)
        advantages = batch.pop("advantages")
        metrics = self.role.update(batch, advantages, meta.get("loss_mode", "ppo_clip"),
                                   clip_low=meta.get("clip_low", 0.2), clip_high=meta.get("clip_high", 0.28),
                                   dis_low=meta.get("dis_low", 0.7), dis_high=meta.get("dis_high", 6.0),
                                   loss_agg_mode=meta.get("loss_agg_mode", "seq-mean-token-mean"))
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


class CriticWorker(_RoleWorker):
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
        self.role = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        from async_rl.models.loading import load_causal_lm
        from async_rl.workers.roles import CriticRole

        ctx = self._init_distributed()  # idempotent when the actor shares this process
        model = load_causal_lm(self.model_path, dtype=self.dtype, device="cpu")
        self.role = CriticRole(model, self.optim, freeze_attention=self.freeze_attention,
                               micro_batch_size=self.micro_batch_size, **self.training.role_kwargs())
        return {"rank": ctx.rank, "world_size": ctx.world_size, "backend": ctx.backend,
                "device": str(self.role.engine.device), "sharded": self.role.engine.is_sharded}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        """``values (bs, T)``: V(s_t) before every response token (0 off real response tokens)."""
        self._require_model()
        _check_keys(data, MODEL_INPUT_KEYS, "compute_values")
        return DataProto.from_dict(tensors={"values": self.role.values(proto_to_batch(data))})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        """One optimizer step of the clipped value loss (the caller drives the K passes).

        ``data.batch`` needs :data:`CRITIC_UPDATE_KEYS`; ``meta_info`` may set ``clip_eps`` and
        ``ranking = {"margin", "coef"}`` (then ``batch["scores"]`` and ``non_tensor_batch["group_ids"]``
        are used). Under DP, groups must not straddle two ranks (dispatch cuts contiguous, equal shards);
        the ranking term is the mean over ranks of each rank's pair mean (exact when every rank holds the
        same number of pairs).
        """
        self._require_model()
        _check_keys(data, CRITIC_UPDATE_KEYS, "update_critic")
        self._free_colocated_rollout_cache()
        meta = data.meta_info
        batch = proto_to_batch(data)
        ranking = None
        if meta.get("ranking") is not None:
            if "scores" not in batch or "group_ids" not in batch:
                raise KeyError("update_critic: ranking needs batch['scores'] and non_tensor_batch['group_ids']")
            ranking = {"scores": batch["scores"], "group_ids": list(batch["group_ids"]),
                       "margin": meta["ranking"]["margin"],
                       "coef": float(meta["ranking"]["coef"]) / max(dist.get_world_size(), 1)}
        metrics = self.role.update(batch, batch["value_targets"], batch["value_mask"], batch["old_values"],
                                   clip_eps=meta.get("clip_eps", 0.2), ranking=ranking)
        metrics = _reduce_metrics(metrics, self.role.engine.device, keep=("critic/grad_norm",),
                                  average=("li2sao/rank_loss",))
        return DataProto(batch=None, non_tensor_batch={}, meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def state_dict(self) -> Optional[dict[str, Any]]:
        self._require_model()
        model, optim = _checkpoint(self.role.engine)
        return {"model": model, "optim": optim} if self.rank == 0 else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_state_dict(self, state: dict[str, Any]) -> bool:
        self._require_model()
        self.role.engine.load_full_state_dict(state["model"])
        if state.get("optim") is not None:
            self.role.engine.load_optimizer_state_dict(state["optim"])
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_sharded(self, directory: str) -> dict[str, Any]:
        """As :meth:`ActorWorker.save_sharded`: every rank writes its shard under ``directory``."""
        self._require_model()
        return self.role.engine.save_sharded(directory)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_sharded(self, directory: str) -> dict[str, Any]:
        self._require_model()
        return self.role.engine.load_sharded(directory)


# ---------------------------------------------------------------------------- rollout dispatch


def _split_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def dispatch_requests(worker_group, data, **kwargs):
    """Split requests over the rollout workers in contiguous, near-equal parts (no padding needed:
    rollout workers run no collectives). ``data``: a DataProto or a list of request dicts."""
    n = worker_group.world_size
    if isinstance(data, DataProto):
        parts = [data.slice(s, e) for s, e in _split_bounds(len(data), n)]
    elif isinstance(data, (list, tuple)):
        parts = [list(data[s:e]) for s, e in _split_bounds(len(data), n)]
    else:
        raise TypeError(f"generate expects a DataProto or a list of request dicts, got {type(data).__name__}")
    return (parts,), {k: [v] * n for k, v in kwargs.items()}


def collect_outputs(worker_group, output):
    """Concatenate the workers' outputs in request order (lists are flattened)."""
    if isinstance(output, list) and output and isinstance(output[0], (DataProto, ray.ObjectRef)):
        if isinstance(output[0], ray.ObjectRef):
            return output  # non-blocking call: the caller resolves
        return DataProto.concat(output)
    return [item for part in output for item in part]


GENERATE_DISPATCH = {"dispatch_fn": dispatch_requests, "collect_fn": collect_outputs}
GENERATION_COLUMNS = ("request_id", "prompt_ids", "token_ids", "logprobs", "versions", "finish_reason", "text",
                      "stop_reason")


def _sampling_from(spec: Mapping[str, Any]):
    from async_rl.rollout.base import SamplingParams

    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = set(spec) - fields
    if unknown:
        raise ValueError(f"unknown sampling parameters {sorted(unknown)}; valid: {sorted(fields)}")
    return SamplingParams(**dict(spec))


def requests_from_dicts(items: Sequence[Mapping[str, Any]]):
    """``[{"request_id", "prompt_ids", "sampling": {...}}]`` (or sampling fields at top level)."""
    from async_rl.rollout.base import GenerationRequest

    requests = []
    for i, item in enumerate(items):
        item = dict(item)
        request_id = item.pop("request_id", i)
        prompt_ids = [int(t) for t in item.pop("prompt_ids")]
        sampling = dict(item.pop("sampling", {}) or {})
        sampling.update(item)
        requests.append(GenerationRequest(request_id, prompt_ids, _sampling_from(sampling)))
    return requests


def requests_from_proto(data: DataProto):
    """Requests from ``non_tensor_batch["prompt_ids"]`` (lists) or from left-padded ``batch["prompts"]``
    + ``batch["prompt_mask"]``; optional ``non_tensor_batch["request_id"]`` and per-row ``["seed"]``;
    shared sampling fields in ``meta_info["sampling"]``."""
    from async_rl.rollout.base import GenerationRequest

    n = len(data)
    if "prompt_ids" in data.non_tensor_batch:
        prompts = [[int(t) for t in p] for p in data.non_tensor_batch["prompt_ids"]]
    elif data.batch is not None and "prompts" in data.batch.keys():
        ids, mask = data.batch["prompts"], data.batch["prompt_mask"]
        prompts = [ids[i][mask[i].bool()].tolist() for i in range(n)]
    else:
        raise KeyError("generate: the DataProto needs non_tensor_batch['prompt_ids'] or batch['prompts'/'prompt_mask']")
    request_ids = list(data.non_tensor_batch.get("request_id", range(n)))
    seeds = data.non_tensor_batch.get("seed")
    shared = dict(data.meta_info.get("sampling", {}) or {})
    requests = []
    for i in range(n):
        spec = dict(shared)
        if seeds is not None and seeds[i] is not None:
            spec["seed"] = int(seeds[i])
        requests.append(GenerationRequest(request_ids[i], prompts[i], _sampling_from(spec)))
    return requests


def outputs_to_proto(outputs, meta_info: Optional[dict] = None) -> DataProto:
    """Generation outputs as a non-tensor DataProto (one object column per :data:`GENERATION_COLUMNS`)."""
    columns = {c: _object_array([getattr(o, c) for o in outputs]) for c in GENERATION_COLUMNS}
    return DataProto(batch=None, non_tensor_batch=columns, meta_info=dict(meta_info or {}))


def outputs_from_proto(proto: DataProto):
    """The inverse of :func:`outputs_to_proto`: a list of ``GenerationOutput``."""
    from async_rl.rollout.base import GenerationOutput

    cols = proto.non_tensor_batch
    return [GenerationOutput(**{c: (list(cols[c][i]) if c in ("prompt_ids", "token_ids", "logprobs", "versions")
                                    else cols[c][i]) for c in GENERATION_COLUMNS})
            for i in range(len(proto))]


class RolloutWorker(_RoleWorker):
    """One rollout engine (:class:`HFRolloutEngine`) per worker.

    Disaggregated: the engine loads its own weights and receives new ones through
    :meth:`update_weights` (a state dict or an object-store ref, with the policy version).
    Colocated (fused with an :class:`ActorWorker` in the same process): with an unsharded actor
    (world size 1) the engine runs **the actor's own module** (no copy at all); with a sharded actor
    the full weights are gathered in-process by :meth:`sync_from_actor` (an all-gather among the train
    ranks, nothing through Ray) and copied into the engine's model.
    """

    def __init__(self, model_path: str, dtype: Optional[str] = None, torch_threads: Optional[int] = 1,
                 device: Optional[str] = None, share_actor_weights: bool = True, initial_version: int = 0):
        super().__init__(torch_threads=torch_threads, device=device)
        self.model_path = str(model_path)
        self.dtype = dtype
        self.share_actor_weights = share_actor_weights
        self.initial_version = initial_version
        self.engine = None
        self.mode = None  # "own-weights" | "shared-module" | "colocated-copy"
        self._synced_update_count = 0
        self._hybrid_held: list = []  # requests that arrived while asleep (admitted at wake-up)
        self._hybrid_sleeping = False

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        """Build the engine. In a colocated process, call it after the actor's ``init_model``."""
        from async_rl.models.loading import load_causal_lm, load_tokenizer
        from async_rl.rollout.hf_engine import HFRolloutEngine

        tokenizer = load_tokenizer(self.model_path)
        actor = self._sibling("actor")
        if actor is not None and actor.role is None:
            raise RuntimeError("colocated RolloutWorker.init_model: initialise the actor first")
        device = torch.device("cpu") if self.device_type == "cpu" else dist.current_device()
        if actor is not None and self.share_actor_weights and not actor.role.engine.is_sharded:
            model, self.mode = actor.role.engine.module, "shared-module"
            device = actor.role.engine.device
        else:
            model = load_causal_lm(self.model_path, dtype=self.dtype, device="cpu")
            self.mode = "colocated-copy" if actor is not None else "own-weights"
        self.engine = HFRolloutEngine(model, tokenizer, device=device, initial_version=self.initial_version)
        if actor is not None:
            self._synced_update_count = actor.update_count
            if self.mode == "colocated-copy":  # the actor may differ from the checkpoint (rank 0 broadcast)
                self.engine.update_weights(actor.role.engine.full_state_dict(), self.initial_version)
        return {"rank": self.rank, "mode": self.mode, "device": str(device), "version": self.engine.policy_version}

    def _require_engine(self):
        if self.engine is None:
            raise RuntimeError(f"{type(self).__name__} rank {self.rank}: call init_model() first")

    @register(dispatch_mode=GENERATE_DISPATCH)
    def generate(self, data):
        """Generate this worker's share of the requests to completion.

        ``data``: a list of request dicts (returns a list of ``GenerationOutput``) or a DataProto
        (returns a DataProto with :data:`GENERATION_COLUMNS` as object columns and
        ``meta_info["metrics"]["rollout/policy_version"]``). Every token carries the version that
        sampled it.
        """
        self._require_engine()
        actor = self._sibling("actor")
        if self.mode == "shared-module":
            if actor.update_count != self._synced_update_count:
                raise RuntimeError(
                    f"the actor took {actor.update_count - self._synced_update_count} optimizer step(s) since "
                    f"the last sync_from_actor(version): call it first so tokens carry the right version")
            self.engine.model.eval()  # the actor's update left the shared module in train mode
        as_proto = isinstance(data, DataProto)
        requests = requests_from_proto(data) if as_proto else requests_from_dicts(data)
        outputs = self.engine.generate(requests) if requests else []
        if not as_proto:
            return outputs
        return outputs_to_proto(outputs, {"metrics": {"rollout/policy_version": self.engine.policy_version}})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def update_weights(self, weights, version: int) -> int:
        """Load new weights with their policy version. ``weights``: a state dict, an ``ObjectRef`` to one,
        or :meth:`ActorWorker.publish_weights`' ``{"version", "ref": [ObjectRef]}``."""
        self._require_engine()
        if isinstance(weights, Mapping) and "ref" in weights and "version" in weights:
            if int(weights["version"]) != int(version):
                raise ValueError(f"update_weights: published version {weights['version']} != requested {version}")
            weights = weights["ref"][0]
        if isinstance(weights, ray.ObjectRef):
            weights = ray.get(weights)
        if self.mode == "shared-module":
            raise RuntimeError("this rollout engine runs the actor's own module: use sync_from_actor(version)")
        self.engine.update_weights(weights, int(version))
        return self.engine.policy_version

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sync_from_actor(self, version: int) -> int:
        """Colocated only: take the fused actor's current weights as ``version`` (in memory, no Ray)."""
        self._require_engine()
        actor = self._sibling("actor")
        if actor is None:
            raise RuntimeError("sync_from_actor needs an ActorWorker in the same process (colocated placement)")
        if self.mode == "shared-module":
            self.engine.update_weights({}, int(version))  # same tensors: set the version, drop KV caches
        else:
            self.engine.update_weights(actor.role.engine.full_state_dict(), int(version))  # all-gather in-process
        self._synced_update_count = actor.update_count
        return self.engine.policy_version

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def policy_version(self) -> int:
        self._require_engine()
        return self.engine.policy_version

    # ---------------------------------------------------------------- rollout.mode=hybrid (docs/rollout.md §8)
    # Called one at a time by this rank's HFHybridServer (async_rl.rollout.hybrid) through the fused worker's
    # ``_fuw_execute``; the worker's actor queue serialises them with the training calls, so generation and
    # training take turns on the shared device. Not worker-group methods: each rank serves its own replica.

    def hybrid_info(self) -> dict[str, Any]:
        """Where the engine runs. A hybrid replica needs its own copy of the weights (``share_actor_weights=False``):
        running the actor's own module, it could not finish a request under version v once the trainer has
        changed the module in place, yet Li2SAO's switch must receive the prefetched job before it publishes v + 1
        (spec §4). verl's hybrid engine keeps its own copy for the same reason (vLLM's weights)."""
        self._require_engine()
        if self.mode == "shared-module":
            raise RuntimeError(f"rollout rank {self.rank} runs the actor's own module; a hybrid replica needs its "
                               f"own weight copy: build the colocated groups with "
                               f"rollout_kwargs={{'share_actor_weights': False}}")
        return {"pid": os.getpid(), "rank": self.rank, "mode": self.mode, "device": str(self.engine.device),
                "version": self.engine.policy_version}

    def _hybrid_admit(self, requests: list) -> dict[Any, str]:
        """Admit requests into the engine; one bad request fails alone (its id -> the error message)."""
        errors: dict[Any, str] = {}
        if not requests:
            return errors
        try:
            self.engine.add_requests(requests)
            return errors
        except ValueError:
            pass
        for request in requests:
            try:
                self.engine.add_requests([request])
            except ValueError as error:
                errors[request.request_id] = str(error)
        return errors

    def hybrid_step(self, requests: list, max_tokens: int) -> dict[str, Any]:
        """Admit ``requests`` (``GenerationRequest`` s) and, when awake, decode up to ``max_tokens`` tokens for every
        unfinished request. Returns the finished outputs, per-request admission errors, whether the engine is
        asleep, its version and how many requests it still holds (held ones included)."""
        self._require_engine()
        self._hybrid_held += list(requests)
        errors: dict[Any, str] = {}
        outputs = []
        if not self._hybrid_sleeping:
            held, self._hybrid_held = self._hybrid_held, []
            errors = self._hybrid_admit(held)
            if self.engine.has_unfinished:
                outputs = self.engine.step(int(max_tokens))
        return {"outputs": outputs, "errors": errors, "asleep": self._hybrid_sleeping,
                "version": self.engine.policy_version,
                "num_unfinished": self.engine.num_unfinished + len(self._hybrid_held)}

    def hybrid_abort(self, request_ids: list) -> list:
        """End these requests as "aborted" (held ones before their first token); returns their outputs."""
        from async_rl.rollout.replica import empty_output

        self._require_engine()
        wanted = set(request_ids)
        held = [r for r in self._hybrid_held if r.request_id in wanted]
        self._hybrid_held = [r for r in self._hybrid_held if r.request_id not in wanted]
        outputs = [empty_output(r) for r in held]
        return outputs + (self.engine.abort(wanted) if self.engine.has_unfinished else [])

    def hybrid_sleep(self) -> dict[str, Any]:
        """Stop decoding and free the KV cache until :meth:`hybrid_wake_up`; requests keep their tokens."""
        self._require_engine()
        self._hybrid_sleeping = True
        self.engine.release_cache()
        return {"asleep": True, "num_unfinished": self.engine.num_unfinished + len(self._hybrid_held)}

    def hybrid_wake_up(self, version: Optional[int] = None) -> dict[str, Any]:
        """Resume decoding. ``version``: first copy the fused actor's current weights in as that policy version (in
        memory, :meth:`sync_from_actor`; unfinished requests are re-prefilled under them); without one the engine
        goes on with the version it holds."""
        self._require_engine()
        if version is not None:
            self.sync_from_actor(int(version))
        self._hybrid_sleeping = False
        return {"version": self.engine.policy_version,
                "num_unfinished": self.engine.num_unfinished + len(self._hybrid_held)}

    def hybrid_progress(self) -> list[dict]:
        """Tokens, log-probs and versions generated so far by every unfinished request (read between chunks)."""
        self._require_engine()
        return self.engine.export_inflight()


# ============================================================================ driver-side helpers


def _first(values):
    return values[0] if isinstance(values, list) else values


SAPO_TURN_KEYS = ("turn_rewards", "turn_dones", "turn_mask", "turn_invalid")


class SapoWorker(ActorWorker):
    """SAPO's single backbone (policy, V and Q from two reserved logits) on one data-parallel rank.

    Same engine interface and weight export as :class:`ActorWorker`; the turn tensors travel in the
    DataProto next to the batch (``turn_rewards``, ``turn_dones``, ``turn_mask``, ``turn_invalid``, all
    ``(bs, K)``), built by the driver from the trajectories (``async_rl.workers.sapo.turn_tensors``).
    """

    def __init__(self, model_path: str, optim: Optional[OptimizerConfig] = None,
                 reserved: Sequence[Any] = ("<|value_plus|>", "<|value_minus|>"), tau_v: float = 5.0,
                 r_max: float = 1.0, kl_coef: float = 0.01, **kwargs: Any):
        super().__init__(model_path, optim, **kwargs)
        self.reserved = tuple(reserved)
        self.tau_v, self.r_max, self.kl_coef = tau_v, r_max, kl_coef

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        from async_rl.models.loading import load_causal_lm, load_tokenizer
        from async_rl.workers.sapo import SapoRole, resolve_reserved_ids

        ctx = self._init_distributed()
        reserved_ids = resolve_reserved_ids(load_tokenizer(self.model_path), list(self.reserved))
        model = load_causal_lm(self.model_path, dtype=self.dtype, device="cpu")
        self.role = SapoRole(model, self.optim, reserved_ids=reserved_ids, tau_v=self.tau_v, r_max=self.r_max,
                             temperature=self.temperature, micro_batch_size=self.micro_batch_size,
                             **self.training.role_kwargs(),
                             kl_coef=self.kl_coef)
        return {"rank": ctx.rank, "world_size": ctx.world_size, "backend": ctx.backend,
                "reserved_ids": list(reserved_ids), "sharded": self.role.engine.is_sharded}

    @staticmethod
    def _split(data: DataProto) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        batch = proto_to_batch(data)
        turns = {key: batch.pop(key) for key in SAPO_TURN_KEYS if key in batch}
        return batch, turns

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_sapo_targets(self, data: DataProto) -> DataProto:
        """Frozen turn targets for this shard (advantage normalisation is global over the group)."""
        self._require_model()
        _check_keys(data, MODEL_INPUT_KEYS + ("response_mask", "token_turn_index"), "compute_sapo_targets")
        missing = [k for k in SAPO_TURN_KEYS if k not in data.batch.keys()]
        if missing:
            raise ValueError(f"compute_sapo_targets: missing turn tensors {missing} (build them with "
                             "async_rl.workers.sapo.turn_tensors(trajectories))")
        meta = data.meta_info
        batch, turns = self._split(data)
        targets = self.role.compute_targets(batch, turns, gamma=meta.get("gamma", 1.0), lam=meta.get("lam", 0.95),
                                            invalid_penalty=meta.get("invalid_penalty", 0.1))
        return DataProto.from_dict(tensors={f"target_{k}": v for k, v in targets.items()})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_sapo(self, data: DataProto) -> DataProto:
        """One joint step ``L_pol + c_V L_V + c_Q L_Q + β KL - c_H H``; global metrics in meta_info."""
        self._require_model()
        self._free_colocated_rollout_cache()
        meta = data.meta_info
        batch, turns = self._split(data)
        targets = {k[len("target_"):]: batch.pop(k) for k in list(batch) if k.startswith("target_")}
        metrics = self.role.update(batch, turns, targets, clip_eps=meta.get("clip_eps", 0.2),
                                   clip_v=meta.get("clip_v", 0.2), clip_q=meta.get("clip_q", 0.2),
                                   c_v=meta.get("c_v", 0.5), c_q=meta.get("c_q", 0.5), c_h=meta.get("c_h", 0.0),
                                   kl_coef=meta.get("kl_coef"))
        self.update_count += 1
        return DataProto(batch=None, non_tensor_batch={}, meta_info={"metrics": metrics})


class RemoteActor:
    """The :class:`~async_rl.workers.roles.ActorRole` calls, served by an ActorWorker group.

    Batches are collated dicts (or DataProtos); padding for DP and the timeout are handled here.
    """

    def __init__(self, worker_group, timeout_s: Optional[float] = None):
        self.wg = worker_group
        self.timeout_s = timeout_s

    def _kw(self, timeout_s):
        t = self.timeout_s if timeout_s is None else timeout_s
        return {} if t is None else {"timeout_s": t}

    def log_probs(self, batch, timeout_s: Optional[float] = None) -> torch.Tensor:
        proto = batch if isinstance(batch, DataProto) else batch_to_proto(batch)
        padded, added = pad_proto_for_dp(proto, self.wg.world_size)
        out = self.wg.compute_log_probs(padded, **self._kw(timeout_s))
        return _unpad(out, added).batch["log_probs"]

    def update(self, batch, advantages: torch.Tensor, loss_mode: str = "ppo_clip", clip_low: float = 0.2,
               clip_high: float = 0.28, dis_low: float = 0.7, dis_high: float = 6.0,
               loss_agg_mode: str = "seq-mean-token-mean", timeout_s: Optional[float] = None) -> dict[str, float]:
        data = dict(proto_to_batch(batch) if isinstance(batch, DataProto) else batch)
        data["advantages"] = advantages
        proto = batch_to_proto(data, {"loss_mode": loss_mode, "clip_low": clip_low, "clip_high": clip_high,
                                      "dis_low": dis_low, "dis_high": dis_high, "loss_agg_mode": loss_agg_mode})
        padded, _ = pad_proto_for_dp(proto, self.wg.world_size)
        return metrics_from_proto(self.wg.update_actor(padded, **self._kw(timeout_s)))

    def export_weights(self, timeout_s: Optional[float] = None) -> dict[str, torch.Tensor]:
        return _first(self.wg.export_weights(**self._kw(timeout_s)))

    def publish_weights(self, version: int, timeout_s: Optional[float] = None) -> dict[str, Any]:
        return _first(self.wg.publish_weights(version, **self._kw(timeout_s)))

    def state_dict(self, timeout_s: Optional[float] = None) -> dict[str, Any]:
        return _first(self.wg.state_dict(**self._kw(timeout_s)))

    def load_state_dict(self, state: dict[str, Any], timeout_s: Optional[float] = None) -> None:
        self.wg.load_state_dict(ray.put(state), **self._kw(timeout_s))

    # checkpoints of the driver (Learner.save_model_shards): every rank writes its own shard
    saves_sharded = True

    @property
    def world_size(self) -> int:
        return int(self.wg.world_size)

    def save_sharded(self, directory, timeout_s: Optional[float] = None) -> dict[str, Any]:
        return _first(self.wg.save_sharded(os.fspath(directory), **self._kw(timeout_s)))

    def load_sharded(self, directory, timeout_s: Optional[float] = None) -> dict[str, Any]:
        return _first(self.wg.load_sharded(os.fspath(directory), **self._kw(timeout_s)))


class RemoteCritic:
    """The :class:`~async_rl.workers.roles.CriticRole` calls, served by a CriticWorker group."""

    def __init__(self, worker_group, timeout_s: Optional[float] = None):
        self.wg = worker_group
        self.timeout_s = timeout_s

    _kw = RemoteActor._kw

    def values(self, batch, timeout_s: Optional[float] = None) -> torch.Tensor:
        proto = batch if isinstance(batch, DataProto) else batch_to_proto(batch)
        padded, added = pad_proto_for_dp(proto, self.wg.world_size)
        return _unpad(self.wg.compute_values(padded, **self._kw(timeout_s)), added).batch["values"]

    def update(self, batch, targets: torch.Tensor, mask: torch.Tensor, old_values: torch.Tensor,
               clip_eps: Optional[float] = 0.2, ranking: Optional[dict[str, Any]] = None,
               timeout_s: Optional[float] = None) -> dict[str, float]:
        data = dict(proto_to_batch(batch) if isinstance(batch, DataProto) else batch)
        data.update(value_targets=targets, value_mask=mask.to(torch.float32), old_values=old_values)
        meta: dict[str, Any] = {"clip_eps": clip_eps}
        if ranking is not None:
            data["scores"] = ranking["scores"]
            data["group_ids"] = list(ranking["group_ids"])
            meta["ranking"] = {"margin": ranking["margin"], "coef": ranking["coef"]}
        padded, _ = pad_proto_for_dp(batch_to_proto(data, meta), self.wg.world_size)
        return metrics_from_proto(self.wg.update_critic(padded, **self._kw(timeout_s)))

    def state_dict(self, timeout_s: Optional[float] = None) -> dict[str, Any]:
        return _first(self.wg.state_dict(**self._kw(timeout_s)))

    def load_state_dict(self, state: dict[str, Any], timeout_s: Optional[float] = None) -> None:
        self.wg.load_state_dict(ray.put(state), **self._kw(timeout_s))

    saves_sharded = True
    world_size = RemoteActor.world_size
    save_sharded = RemoteActor.save_sharded
    load_sharded = RemoteActor.load_sharded


# rows added by pad_proto_for_dp to a SAPO batch: no model token, no valid turn, hence no loss weight and no share
# of the global turn-advantage statistics (the frozen targets of such a row are zero too)
SAPO_ZERO_WEIGHT_KEYS = ("response_mask", "turn_mask", "target_turn_mask", "target_token_advantages")


class RemoteSapo:
    """The :class:`~async_rl.workers.sapo.SapoRole` calls the learner makes (spec §5), served by a
    :class:`SapoWorker` group: ``turn_tensors``, ``compute_targets``, ``update``, the weight export and
    checkpoints, and ``banned_token_ids`` for the rollout's sampling.

    Batches are collated dicts; the turn tensors and the frozen targets travel in the same DataProto as
    the batch (targets as ``target_<name>`` columns), padded for DP with zero-weight rows
    (:data:`SAPO_ZERO_WEIGHT_KEYS`). Every rank returns the global metrics (``SapoRole.update``
    all-reduces them), so the driver reads one.
    """

    def __init__(self, worker_group, reserved_ids: Sequence[int], timeout_s: Optional[float] = None):
        if len(tuple(reserved_ids)) != 2:
            raise ValueError(f"RemoteSapo needs the two reserved value ids (w+, w-), got {tuple(reserved_ids)}")
        self.wg = worker_group
        self.reserved_ids = tuple(int(i) for i in reserved_ids)
        self.timeout_s = timeout_s

    _kw = RemoteActor._kw
    export_weights = RemoteActor.export_weights
    publish_weights = RemoteActor.publish_weights
    state_dict = RemoteActor.state_dict
    load_state_dict = RemoteActor.load_state_dict
    saves_sharded = True  # driver checkpoints: SapoWorker inherits ActorWorker's save_sharded/load_sharded
    world_size = RemoteActor.world_size
    save_sharded = RemoteActor.save_sharded
    load_sharded = RemoteActor.load_sharded

    @property
    def banned_token_ids(self) -> tuple[int, int]:
        """The rollout never samples the reserved ids (their logits are the V/Q readout)."""
        return self.reserved_ids

    def turn_tensors(self, trajectories_or_batch, num_turns: Optional[int] = None) -> dict[str, torch.Tensor]:
        """See :func:`async_rl.workers.sapo.turn_tensors` (built in the driver: it reads the trajectories)."""
        from async_rl.workers.sapo import turn_tensors

        return turn_tensors(trajectories_or_batch, num_turns)

    def _padded_proto(self, batch, turns, targets=None, meta_info=None) -> tuple[DataProto, int]:
        data = dict(proto_to_batch(batch) if isinstance(batch, DataProto) else batch)
        data.update({key: turns[key] for key in SAPO_TURN_KEYS if key in turns})
        if targets is not None:
            data.update({f"target_{key}": value for key, value in targets.items() if torch.is_tensor(value)})
        return pad_proto_for_dp(batch_to_proto(data, meta_info), self.wg.world_size, zero_keys=SAPO_ZERO_WEIGHT_KEYS)

    def compute_targets(self, batch, turns: Mapping[str, torch.Tensor], gamma: float = 1.0, lam: float = 0.95,
                        invalid_penalty: float = 0.1, timeout_s: Optional[float] = None) -> dict[str, torch.Tensor]:
        """Frozen turn targets of the whole batch (rows in batch order), as ``SapoRole.compute_targets``."""
        proto, added = self._padded_proto(batch, turns, meta_info={"gamma": float(gamma), "lam": float(lam),
                                                                    "invalid_penalty": float(invalid_penalty)})
        out = _unpad(self.wg.compute_sapo_targets(proto, **self._kw(timeout_s)), added)
        return {key[len("target_"):]: out.batch[key] for key in out.batch.keys()}

    def update(self, batch, turns: Optional[Mapping[str, torch.Tensor]], targets: Mapping[str, torch.Tensor],
               clip_eps: float = 0.2, clip_v: float = 0.2, clip_q: float = 0.2, c_v: float = 0.5, c_q: float = 0.5,
               c_h: float = 0.0, kl_coef: Optional[float] = None,
               timeout_s: Optional[float] = None) -> dict[str, float]:
        """One joint optimizer step over all ranks (``SapoRole.update``); returns its global metrics."""
        if turns is None:  # the targets carry the combined turn mask: the workers only need it for the shapes
            turns = {"turn_mask": targets["turn_mask"]}
        if turns["turn_mask"].shape != targets["turn_mask"].shape:
            raise ValueError("turns and targets disagree on (bs, K): recompute the targets for this batch")
        meta = {"clip_eps": float(clip_eps), "clip_v": float(clip_v), "clip_q": float(clip_q), "c_v": float(c_v),
                "c_q": float(c_q), "c_h": float(c_h), "kl_coef": None if kl_coef is None else float(kl_coef)}
        proto, _ = self._padded_proto(batch, turns, targets, meta)
        return metrics_from_proto(self.wg.update_sapo(proto, **self._kw(timeout_s)))


__all__ = [
    "ACTOR_UPDATE_KEYS", "CRITIC_UPDATE_KEYS", "DEFAULT_CALL_TIMEOUT_S", "GENERATION_COLUMNS", "MODEL_INPUT_KEYS",
    "ActorWorker", "CriticWorker", "RemoteActor", "RemoteCritic", "RemoteSapo", "RolloutWorker", "SAPO_TURN_KEYS",
    "SAPO_ZERO_WEIGHT_KEYS", "SapoWorker", "TimedRayWorkerGroup",
    "WorkerCallError", "WorkerTimeoutError", "batch_to_proto", "metrics_from_proto", "outputs_from_proto",
    "outputs_to_proto", "pad_proto_for_dp", "proto_to_batch", "requests_from_dicts", "requests_from_proto",
    "wait_for_workers",
]
