"""Training-engine interface: one model, its optimizer, and data-parallel gradient math.

Entry points: :class:`TrainEngine` (implemented by :class:`~async_rl.engine.fsdp.FSDPEngine`),
:class:`OptimizerConfig`, :class:`GlobalDenominator`. The loss-scaling contract: a step's objective is
always a global sum divided by a global count; engines *sum* gradients over data-parallel ranks, and
:meth:`TrainEngine.backward` divides the local sum by a :class:`GlobalDenominator`, which only
:meth:`TrainEngine.global_denominator` creates (an all-reduce of the local count). So no caller multiplies
by ``world_size``, and the DP gradient equals the full-batch single-process gradient for any split.

Details: docs/engine.md (§2 The engine interface; §3 Loss scaling for data parallelism).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from async_rl.engine import dist


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW hyper-parameters and gradient clipping.

    Attributes:
        lr: learning rate.
        betas: AdamW (beta1, beta2).
        eps: AdamW epsilon.
        weight_decay: decoupled weight decay (AdamW).
        max_grad_norm: clip the global gradient L2 norm to this value; ``None`` = no clipping
            (the norm is still computed and returned by ``step``).
    """

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0


@dataclass(frozen=True)
class GlobalDenominator:
    """A loss normaliser already summed over every data-parallel rank.

    Create it with :meth:`TrainEngine.global_denominator` (which performs the all-reduce);
    :meth:`TrainEngine.backward` accepts nothing else. ``value`` may be 0 when the global
    batch has no valid element; backward then contributes zero gradient.
    """

    value: float
    world_size: int


class TrainEngine(abc.ABC):
    """A trainable model + optimizer that may be sharded over data-parallel ranks.

    Collective discipline: under data parallelism every rank must call ``forward``,
    ``backward``, ``step``, ``global_denominator`` and the state-dict methods the same
    number of times in the same order (they contain collectives); pad a short rank with a
    zero-weight micro-batch rather than skipping a call.
    """

    # -- identity --------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def module(self) -> nn.Module:
        """The (possibly FSDP-wrapped) model; call it like the original model."""

    @property
    @abc.abstractmethod
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer over the trainable (``requires_grad``) parameters."""

    @property
    def device(self) -> torch.device:
        """Device the model computes on (from :mod:`async_rl.engine.dist`)."""
        return dist.current_device()

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    # -- compute -----------------------------------------------------------------------
    def forward(self, batch: Mapping[str, Any], **kwargs: Any) -> Any:
        """Call the model with ``batch`` as keyword arguments (tensors moved to :attr:`device`).

        Args:
            batch: model inputs, e.g. ``{"input_ids": (bs, T), "attention_mask": (bs, T)}``.
            **kwargs: extra non-tensor model arguments (e.g. ``use_cache=False``).

        Returns:
            Whatever the model returns (graph attached: differentiate it via :meth:`backward`).
        """
        inputs = {key: value.to(self.device) if torch.is_tensor(value) else value for key, value in batch.items()}
        return self.module(**inputs, **kwargs)

    def global_denominator(self, local_count: torch.Tensor | float | int) -> GlobalDenominator:
        """Sum a rank-local normaliser (token count, sequence count, ...) over all ranks.

        Args:
            local_count: this rank's count for the whole step (all its micro-batches), a
                Python number or a scalar tensor such as ``mask.sum()``.

        Returns:
            A :class:`GlobalDenominator` to pass to :meth:`backward` for every micro-batch
            of the step. Contains one all-reduce when distributed.
        """
        count = torch.as_tensor(local_count, dtype=torch.float64).detach().reshape(())
        # Reduce on the group's device: NCCL cannot reduce CPU tensors. float64 keeps token
        # counts exact far beyond float32's 2**24.
        count = count.to(self.device)
        dist.all_reduce_sum(count)
        return GlobalDenominator(value=float(count.item()), world_size=self.world_size)

    def backward(self, loss_sum: torch.Tensor, denominator: GlobalDenominator) -> torch.Tensor:
        """Back-propagate ``loss_sum / denominator`` (gradients accumulate across calls).

        Args:
            loss_sum: scalar tensor, this rank's (micro-batch's) *sum* of loss terms.
            denominator: from :meth:`global_denominator`, shared by all micro-batches of the step.

        Returns:
            The detached scalar ``loss_sum / denominator``: this rank's share of the global
            loss. Summing it over micro-batches and ranks (e.g. :func:`dist.all_reduce_sum`)
            gives the global loss.
        """
        if not isinstance(denominator, GlobalDenominator):
            raise TypeError(
                "backward(loss_sum, denominator): denominator must come from engine.global_denominator("
                f"local_count), got {type(denominator).__name__}; a rank-local count would silently "
                "scale the data-parallel gradient by the rank's share of the batch."
            )
        if denominator.world_size != self.world_size:
            raise ValueError(
                f"denominator was reduced over {denominator.world_size} ranks but the engine runs on {self.world_size}"
            )
        if loss_sum.dim() != 0:
            raise ValueError(f"loss_sum must be a scalar, got shape {tuple(loss_sum.shape)}")
        # 0 valid elements globally: the masked sum is 0 too; scale 0 keeps the backward
        # (and its collectives) running on every rank instead of producing nan.
        scale = 1.0 / denominator.value if denominator.value > 0 else 0.0
        loss = loss_sum * scale
        self._backward(loss)
        return loss.detach()

    @abc.abstractmethod
    def _backward(self, loss: torch.Tensor) -> None:
        """Back-propagate an already-normalised scalar; gradients must be SUMMED over ranks."""

    @abc.abstractmethod
    def step(self) -> float:
        """Clip gradients, take an optimizer step, zero gradients.

        Returns:
            The global gradient L2 norm before clipping. If it is not finite the update is
            skipped (gradients are still zeroed).
        """

    def zero_grad(self) -> None:
        """Drop all gradients (``set_to_none``)."""
        self.optimizer.zero_grad(set_to_none=True)

    def train_mode(self) -> None:
        """Enable dropout etc. (``module.train()``)."""
        self.module.train()

    def eval_mode(self) -> None:
        """Disable dropout etc. (``module.eval()``)."""
        self.module.eval()

    @contextmanager
    def eval_context(self):
        """Temporarily switch to eval mode (restores the previous mode on exit)."""
        was_training = self.module.training
        self.eval_mode()
        try:
            yield self
        finally:
            if was_training:
                self.train_mode()

    # -- state -------------------------------------------------------------------------
    @abc.abstractmethod
    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Full (unsharded) model weights as CPU tensors keyed by the original module's names.

        Args:
            rank0_only: gather onto rank 0 only (other ranks get ``{}``); saves host memory
                on checkpoints. Default: every rank gets the full dict (weight sync).
        """

    @abc.abstractmethod
    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor], *, from_rank0_only: bool = False) -> None:
        """Load full (unsharded) weights, resharding them onto this engine's layout.

        Args:
            state_dict: as returned by :meth:`full_state_dict` (any world size).
            from_rank0_only: only rank 0 holds ``state_dict`` (others pass ``{}``); it is
                broadcast.
        """

    @abc.abstractmethod
    def optimizer_state_dict(self, *, rank0_only: bool = False) -> dict[str, Any]:
        """Full optimizer state keyed by parameter *names* (loadable at any world size)."""

    @abc.abstractmethod
    def load_optimizer_state_dict(self, state_dict: Mapping[str, Any], *, from_rank0_only: bool = False) -> None:
        """Load an :meth:`optimizer_state_dict` (possibly saved at another world size)."""

    @abc.abstractmethod
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Gathered full gradients (CPU) of trainable parameters with a gradient (debug/tests)."""

    @property
    @abc.abstractmethod
    def num_parameters(self) -> int:
        """Total (global, unsharded) number of model parameters."""

    @abc.abstractmethod
    def model_state_bytes(self) -> int:
        """Bytes held *on this rank* by parameters + gradients + optimizer state."""
