"""SAPO's single backbone (policy, V and Q, spec §5) as a verl worker on one data-parallel rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from verl.single_controller.base.decorator import Dispatch, register

from async_rl.engine.base import OptimizerConfig
from async_rl.workers.train_workers import ActorWorker


class SapoWorker(ActorWorker):
    """SAPO's single backbone (policy, V and Q from two reserved logits) on one data-parallel rank.

    Same engine interface and weight export as :class:`ActorWorker`; the learner's calls (``SapoRole.readouts``,
    ``SapoRole.update``) go through the inherited ``call_role`` (their turn tensors and frozen targets travel as
    columns next to the batch).
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
        model = load_causal_lm(self.model_path, dtype=self.dtype, device="cpu", **self.training.model_kwargs())
        self.role = SapoRole(model, self.optim, reserved_ids=reserved_ids, tau_v=self.tau_v, r_max=self.r_max,
                             temperature=self.temperature, micro_batch_size=self.micro_batch_size,
                             **self.training.role_kwargs(),
                             kl_coef=self.kl_coef)
        return {"rank": ctx.rank, "world_size": ctx.world_size, "backend": ctx.backend,
                "reserved_ids": list(reserved_ids), "sharded": self.role.engine.is_sharded}
