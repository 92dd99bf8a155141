"""FSDP2 data-parallel training engine (CPU/gloo and CUDA/NCCL alike): :class:`FSDPEngine`.

World size 1 (or no process group): a plain module. World size N > 1: ``fully_shard`` on every decoder
layer (:func:`find_shard_units`), then on the root, over a 1-D mesh of all ranks (ZeRO-3); device and
backend come from :mod:`async_rl.engine.dist`. Gradients are reduce-scattered with a plain SUM, the
normalisation lives in :meth:`TrainEngine.backward` (:mod:`async_rl.engine.base`). ``precision`` (fp32
master weights always): :mod:`async_rl.engine.precision`; ``activation_checkpointing=True``:
:func:`enable_activation_checkpointing`.

Details: docs/engine.md (§2 The engine interface, §3 Loss scaling, §4 Why verl's FSDP engine is not
wrapped, §7 Precision and memory-bounded updates).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from async_rl.engine import dist
from async_rl.engine.base import OptimizerConfig, TrainEngine
from async_rl.engine.precision import compute_context, install_root_forward, resolve_compute_dtype, validate_precision


def find_shard_units(model: nn.Module) -> list[nn.Module]:
    """The sub-modules to shard individually: the transformer blocks.

    Uses the HF ``_no_split_modules`` class names (e.g. ``Qwen2DecoderLayer``) declared by
    any ``PreTrainedModel`` inside ``model`` (so a :class:`CriticModel` wrapping a backbone
    works too); without them, falls back to the elements of every ``nn.ModuleList``.

    Returns:
        Modules in pre-order (outer before inner); shard them in reverse.
    """
    block_class_names: set[str] = set()
    for module in model.modules():
        block_class_names.update(getattr(module, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if type(m).__name__ in block_class_names and m is not model]
    if not units:
        units = [
            child
            for module in model.modules()
            if isinstance(module, nn.ModuleList)
            for child in module
            if any(True for _ in child.parameters())
        ]
    return units


def _hf_checkpointable(module: nn.Module) -> bool:
    return bool(getattr(module, "supports_gradient_checkpointing", False)) and hasattr(
        module, "gradient_checkpointing_enable")


def _checkpointed_forward(unit: nn.Module, forward):
    """``unit.forward`` recomputed in backward (non-reentrant checkpoint) while the unit trains."""

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        if unit.training and torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    return wrapped


def enable_activation_checkpointing(model: nn.Module) -> str:
    """Recompute each decoder block's activations in backward instead of storing them.

    Hugging Face models inside ``model`` (a causal LM, or a critic's backbone) use their own
    ``gradient_checkpointing_enable`` (non-reentrant ``torch.utils.checkpoint`` per decoder layer);
    any other model gets the same checkpoint around each :func:`find_shard_units` block. Active in
    train mode only (eval/no-grad forwards store nothing anyway).

    Returns:
        ``"hf"`` or ``"blocks"``: which mechanism was used.

    Raises:
        ValueError: when the model has neither a Hugging Face model nor repeated blocks.
    """
    hf_models = [m for m in model.modules() if _hf_checkpointable(m)]
    if hf_models:
        for hf_model in hf_models:
            hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return "hf"
    units = find_shard_units(model)
    if not units:
        raise ValueError(
            f"activation_checkpointing=true: {type(model).__name__} has no Hugging Face model and no "
            "nn.ModuleList of blocks to checkpoint; set trainer.activation_checkpointing=false"
        )
    for unit in units:
        unit.forward = _checkpointed_forward(unit, unit.forward)
    return "blocks"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _tensor_bytes(tensor: torch.Tensor) -> int:
    local = _local(tensor)
    return local.numel() * local.element_size()


def _copy_tensors(tree: Any, device: str | None = None) -> Any:
    """Copy every tensor of a nested dict/list/tuple (to ``device`` if given) so the result
    shares no storage with live model or optimizer state."""
    if torch.is_tensor(tree):
        return tree.detach().to(device or tree.device, copy=True)
    if isinstance(tree, Mapping):
        return {key: _copy_tensors(value, device) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_copy_tensors(value, device) for value in tree]
    if isinstance(tree, tuple):
        return tuple(_copy_tensors(value, device) for value in tree)
    return tree


def _detached_cpu_copy(tree: Any) -> Any:
    """Fresh CPU copies of every tensor in a nested structure."""
    return _copy_tensors(tree, "cpu")


class FSDPEngine(TrainEngine):
    """Data-parallel (FSDP2) engine around one ``nn.Module`` with AdamW.

    Args:
        model: the model, full weights on every rank (CPU or already on the device). With
            more than one rank, rank 0's weights are broadcast first when
            ``sync_module_states`` (so differently seeded ranks still start identical).
            Freeze parameters (``requires_grad=False``) *before* constructing the engine.
        optim: AdamW / clipping settings.
        reshard_after_forward: FSDP2 ZeRO-3 (True, frees gathered weights after forward)
            or ZeRO-2-like (False, keeps them until backward: faster, more memory).
        sync_module_states: broadcast rank 0's parameters and buffers before sharding.
        precision: ``"fp32"`` or ``"bf16"`` compute (``trainer.precision``). Either way the
            parameters, gradients and AdamW state are float32 (a bf16 model is upcast here).
        activation_checkpointing: recompute decoder blocks in backward
            (``trainer.activation_checkpointing``; see :func:`enable_activation_checkpointing`).

    The process group (if any) must exist before construction
    (:func:`async_rl.engine.dist.init_distributed`).
    """

    def __init__(
        self,
        model: nn.Module,
        optim: OptimizerConfig | None = None,
        *,
        reshard_after_forward: bool = True,
        sync_module_states: bool = True,
        precision: str = "fp32",
        activation_checkpointing: bool = False,
    ):
        self.optim_config = optim or OptimizerConfig()
        self.precision = validate_precision(precision)
        self._device = dist.current_device()
        self._compute_dtype = resolve_compute_dtype(precision, self._device)
        world_size = dist.get_world_size()
        self._num_parameters = sum(p.numel() for p in model.parameters())

        # float32 master weights whatever the checkpoint's dtype: a bf16 parameter cannot hold an
        # lr=1e-6 update (see async_rl.engine.precision). Only floating tensors are cast.
        model = model.to(device=self._device, dtype=torch.float32)
        self.activation_checkpointing = (
            enable_activation_checkpointing(model) if activation_checkpointing else None
        )
        self._sharded = world_size > 1
        if self._sharded:
            if sync_module_states:
                self._broadcast_from_rank0(model)
            mesh = init_device_mesh(self._device.type, (world_size,))
            # bf16: FSDP gathers bf16 copies of the fp32 shards and reduce-scatters fp32 gradients
            mp_policy = (MixedPrecisionPolicy(param_dtype=self._compute_dtype, reduce_dtype=torch.float32)
                         if self._compute_dtype != torch.float32 else MixedPrecisionPolicy())
            for unit in reversed(find_shard_units(model)):
                fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
            fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    # SUM-reduce gradients: backward() already divided by the global count.
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)
        install_root_forward(model, self.compute_context)
        self._module = model

        # Collected after fully_shard, which replaces parameters with sharded DTensors.
        self._trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if not self._trainable:
            raise ValueError("FSDPEngine: the model has no trainable parameter (all requires_grad=False)")
        cfg = self.optim_config
        self._optimizer = torch.optim.AdamW(
            [p for _, p in self._trainable],
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
        )

    @staticmethod
    def _broadcast_from_rank0(model: nn.Module) -> None:
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                torch_dist.broadcast(tensor.data, src=0)

    # -- identity --------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self._module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def is_sharded(self) -> bool:
        """True when the model is wrapped with FSDP2 (world size > 1)."""
        return self._sharded

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype of the forward/backward math (bf16 only when requested and supported)."""
        return self._compute_dtype

    def compute_context(self) -> contextlib.AbstractContextManager:
        """The precision context every call of :attr:`module` runs under (autocast for bf16).

        Use it around forwards of other models that should compute like this one (e.g. a frozen
        reference policy)."""
        return compute_context(self._device, self._compute_dtype)

    # -- compute -----------------------------------------------------------------------
    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        params = [p for _, p in self._trainable]
        max_norm = self.optim_config.max_grad_norm
        # clip_grad_norm_ computes the global norm over DTensor shards (one all-reduce).
        # With max_norm=inf it only measures.
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=math.inf if max_norm is None else max_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        grad_norm_value = float(grad_norm)
        if math.isfinite(grad_norm_value):
            self._optimizer.step()
        # Non-finite: skip the update (one bad batch must not destroy the weights); every
        # rank sees the same global norm, so all ranks skip together.
        self.zero_grad()
        return grad_norm_value

    # -- state -------------------------------------------------------------------------
    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        if not self._sharded:
            return _detached_cpu_copy(get_model_state_dict(self._module))
        if rank0_only:
            # cpu_offload=True gathers onto rank 0's host memory only; other ranks get {}.
            return get_model_state_dict(self._module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        gathered = get_model_state_dict(self._module, options=StateDictOptions(full_state_dict=True))
        return _detached_cpu_copy(gathered)

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor], *, from_rank0_only: bool = False) -> None:
        options = StateDictOptions(
            full_state_dict=True,
            broadcast_from_rank0=from_rank0_only and self._sharded,
        )
        set_model_state_dict(self._module, dict(state_dict), options=options)

    def optimizer_state_dict(self, *, rank0_only: bool = False) -> dict[str, Any]:
        """Full optimizer state: ``{"state": {param_name: {"step", "exp_avg", "exp_avg_sq"}},
        "param_groups": [...]}``, unsharded CPU tensors keyed by parameter name, so a
        checkpoint written at one world size loads at another. ``rank0_only`` as in
        :meth:`full_state_dict`."""
        if not self._optimizer.state:
            # before the first step there is nothing to save; torch's getter would *initialise* AdamW with
            # a zero-gradient step(), advancing its step counter and changing the next real update
            return {"state": {}, "param_groups": None}
        options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only and self._sharded)
        state = get_optimizer_state_dict(self._module, self._optimizer, options=options)
        if rank0_only and self._sharded:
            return state
        return _detached_cpu_copy(state)

    def load_optimizer_state_dict(self, state_dict: Mapping[str, Any], *, from_rank0_only: bool = False) -> None:
        if not state_dict.get("state") and state_dict.get("param_groups") is None:
            self._optimizer.state.clear()  # saved before the first step: a fresh optimizer
            return
        options = StateDictOptions(
            full_state_dict=True,
            broadcast_from_rank0=from_rank0_only and self._sharded,
        )
        # Copy first: for an unsharded module, set_optimizer_state_dict adopts the given tensors
        # as the live optimizer state, so later steps would silently mutate the caller's dict.
        set_optimizer_state_dict(self._module, self._optimizer, _copy_tensors(state_dict), options=options)

    # -- sharded checkpoints (torch.distributed.checkpoint) -----------------------------------------------
    SHARDED_META = "engine.json"  # written by rank 0 next to DCP's own files

    def save_sharded(self, directory: str | os.PathLike) -> dict[str, Any]:
        """Save model and AdamW state to ``directory`` with ``torch.distributed.checkpoint``: every rank
        writes its own shard (``__<rank>_0.distcp``), rank 0 the DCP ``.metadata`` and :attr:`SHARDED_META`.

        A collective: every rank calls it with the same ``directory``, which must be one file system all
        ranks see (one machine, or a shared mount). Nothing is gathered: the peak memory is this rank's
        shard. A fresh optimizer (no step yet) is saved as "no optimizer state" (taking its state dict would
        initialise AdamW, see :meth:`optimizer_state_dict`); every rank agrees, since all ranks step together.

        Returns:
            What :attr:`SHARDED_META` holds: ``{"format", "world_size", "optimizer_state", "num_parameters"}``.
        """
        directory = os.fspath(directory)
        has_optimizer_state = bool(self._optimizer.state)
        state: dict[str, Any] = {"model": get_model_state_dict(self._module)}
        if has_optimizer_state:
            state["optim"] = get_optimizer_state_dict(self._module, self._optimizer)
        meta = {"format": 1, "world_size": self.world_size, "optimizer_state": has_optimizer_state,
                "num_parameters": self._num_parameters}
        if dist.get_rank() == 0:
            os.makedirs(directory, exist_ok=True)
        self._barrier()  # the directory exists before any rank writes into it
        dcp.save(state, checkpoint_id=directory, no_dist=not self._sharded)
        if dist.get_rank() == 0:
            with open(os.path.join(directory, self.SHARDED_META), "w") as handle:
                json.dump(meta, handle)
                handle.flush()
                os.fsync(handle.fileno())
        self._barrier()  # every shard and the metadata are on disk when any rank returns
        return meta

    def load_sharded(self, directory: str | os.PathLike) -> dict[str, Any]:
        """Load what :meth:`save_sharded` wrote, at this engine's world size (a collective).

        The saved world size may differ: DCP stores every tensor's global shape and each shard's offsets,
        and reads into this engine's own sharding (resharding), so a checkpoint saved on 2 ranks loads on 1
        or 4. A checkpoint of another model fails with one line naming both parameter counts.

        Returns:
            The saved :attr:`SHARDED_META` (its ``world_size`` is the world size it was saved at).
        """
        directory = os.fspath(directory)
        meta_path = os.path.join(directory, self.SHARDED_META)
        if not os.path.isfile(meta_path):
            raise FileNotFoundError(f"{directory} is not a sharded engine checkpoint: {self.SHARDED_META} is "
                                    "missing (written last by save_sharded; the save did not finish)")
        with open(meta_path) as handle:
            meta = json.load(handle)
        if int(meta.get("num_parameters", -1)) != self._num_parameters:
            raise ValueError(f"sharded checkpoint {directory} holds a model of {meta.get('num_parameters')} "
                             f"parameters, this engine's has {self._num_parameters}: resume with the model it "
                             "was saved with")
        state: dict[str, Any] = {"model": get_model_state_dict(self._module)}
        if meta["optimizer_state"]:
            # the getter initialises an empty AdamW (zero-gradient step at lr=0): the structure to read into
            state["optim"] = get_optimizer_state_dict(self._module, self._optimizer)
        dcp.load(state, checkpoint_id=directory, no_dist=not self._sharded)
        set_model_state_dict(self._module, state["model"])
        if meta["optimizer_state"]:
            set_optimizer_state_dict(self._module, self._optimizer, state["optim"])
        else:
            self._optimizer.state.clear()  # saved before the first step: a fresh optimizer
        self.zero_grad()
        return meta

    def _barrier(self) -> None:
        if self._sharded:
            torch_dist.barrier()

    def full_gradients(self) -> dict[str, torch.Tensor]:
        gradients = {}
        for name, param in self._trainable:
            if param.grad is None:
                continue
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            gradients[name] = grad.detach().to("cpu", copy=True)
        return gradients

    @property
    def num_parameters(self) -> int:
        return self._num_parameters

    @property
    def num_trainable_parameters(self) -> int:
        """Global number of parameters the optimizer updates."""
        return sum(p.numel() for _, p in self._trainable)

    def model_state_bytes(self) -> int:
        total = sum(_tensor_bytes(p) for p in self._module.parameters())
        total += sum(_tensor_bytes(p.grad) for p in self._module.parameters() if p.grad is not None)
        for per_param_state in self._optimizer.state.values():
            total += sum(_tensor_bytes(v) for v in per_param_state.values() if torch.is_tensor(v))
        return total
