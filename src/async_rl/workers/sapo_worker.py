"""SAPO's single backbone (policy, V and Q, spec §5) as a verl worker on one data-parallel rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from verl.protocol import DataProto
from verl.single_controller.base.decorator import Dispatch, register

from async_rl.engine.base import OptimizerConfig
from async_rl.workers.proto import MODEL_INPUT_KEYS, SAPO_TURN_KEYS, check_keys, proto_to_batch
from async_rl.workers.train_workers import ActorWorker


class SapoWorker(ActorWorker):
    """SAPO's single backbone (policy, V and Q from two reserved logits) on one data-parallel rank.

    Same engine interface and weight export as :class:`ActorWorker`; the turn tensors travel in the
    DataProto next to the batch (``turn_rewards``, ``turn_dones``, ``turn_mask``, ``turn_invalid``, all
    ``(bs, K)``), built by the driver from the trajectories (``async_rl.driver.batch.turn_tensors``).
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

    @staticmethod
    def _split(data: DataProto) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        batch = proto_to_batch(data)
        turns = {key: batch.pop(key) for key in SAPO_TURN_KEYS if key in batch}
        return batch, turns

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_sapo_readouts(self, data: DataProto) -> DataProto:
        """The frozen old readouts of this shard (``SapoRole.readouts``) as ``readout_<name>`` columns."""
        self._require_model()
        check_keys(data, MODEL_INPUT_KEYS + ("response_mask", "token_turn_index"), "compute_sapo_readouts")
        batch, _ = self._split(data)
        readouts = self.role.readouts(batch, data.meta_info.get("num_turns"))
        return DataProto.from_dict(tensors={f"readout_{k}": v for k, v in readouts.items()})

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
