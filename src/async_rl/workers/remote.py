"""Driver-side adapters: the learner calls a worker group as it calls a local role (``RemoteActor``,
``RemoteCritic``, ``RemoteSapo``); batches are padded to the world size and the padding dropped again."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import ray
import torch
from verl.protocol import DataProto

from async_rl.algos.dis import DIS_HIGH, DIS_LOW
from async_rl.algos.policy import CLIP_HIGH, CLIP_LOW
from async_rl.algos.sapo import num_turns_of
from async_rl.workers.proto import (SAPO_TURN_KEYS, batch_to_proto, metrics_from_proto, pad_proto_for_dp,
                                    proto_to_batch, unpad)


def _first(values):
    return values[0] if isinstance(values, list) else values


class RemoteRole:
    """What every driver-side adapter shares, written once: the worker group, the call timeout, and the
    checkpoint calls of a :class:`~async_rl.workers.train_workers.TrainedRoleWorker` group (full state through
    rank 0, or every rank its shard: the driver's checkpoints use the sharded form, ``saves_sharded``)."""

    saves_sharded = True

    def __init__(self, worker_group, timeout_s: Optional[float] = None):
        self.wg = worker_group
        self.timeout_s = timeout_s

    def _kw(self, timeout_s):
        t = self.timeout_s if timeout_s is None else timeout_s
        return {} if t is None else {"timeout_s": t}

    @property
    def world_size(self) -> int:
        return int(self.wg.world_size)

    def state_dict(self, timeout_s: Optional[float] = None) -> dict[str, Any]:
        return _first(self.wg.state_dict(**self._kw(timeout_s)))

    def load_state_dict(self, state: dict[str, Any], timeout_s: Optional[float] = None) -> None:
        self.wg.load_state_dict(ray.put(state), **self._kw(timeout_s))

    def save_sharded(self, directory, timeout_s: Optional[float] = None) -> dict[str, Any]:
        return _first(self.wg.save_sharded(os.fspath(directory), **self._kw(timeout_s)))

    def load_sharded(self, directory, timeout_s: Optional[float] = None) -> dict[str, Any]:
        return _first(self.wg.load_sharded(os.fspath(directory), **self._kw(timeout_s)))


class RemoteActor(RemoteRole):
    """The :class:`~async_rl.workers.roles.ActorRole` calls, served by an ActorWorker group.

    Batches are collated dicts (or DataProtos); padding for DP and the timeout are handled here.
    """

    def log_probs(self, batch, timeout_s: Optional[float] = None) -> torch.Tensor:
        proto = batch if isinstance(batch, DataProto) else batch_to_proto(batch)
        padded, added = pad_proto_for_dp(proto, self.wg.world_size)
        out = self.wg.compute_log_probs(padded, **self._kw(timeout_s))
        return unpad(out, added).batch["log_probs"]

    def update(self, batch, advantages: torch.Tensor, loss_mode: str = "ppo_clip", clip_low: float = CLIP_LOW,
               clip_high: float = CLIP_HIGH, dis_low: float = DIS_LOW, dis_high: float = DIS_HIGH,
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


class RemoteCritic(RemoteRole):
    """The :class:`~async_rl.workers.roles.CriticRole` calls, served by a CriticWorker group."""

    def values(self, batch, timeout_s: Optional[float] = None) -> torch.Tensor:
        proto = batch if isinstance(batch, DataProto) else batch_to_proto(batch)
        padded, added = pad_proto_for_dp(proto, self.wg.world_size)
        return unpad(self.wg.compute_values(padded, **self._kw(timeout_s)), added).batch["values"]

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


# rows added by pad_proto_for_dp to a SAPO batch: no model token, no valid turn, hence no loss weight (the frozen
# targets of such a row are zero too); the driver computed the turn advantages on the unpadded batch
SAPO_ZERO_WEIGHT_KEYS = ("response_mask", "turn_mask", "target_turn_mask", "target_token_advantages")


class RemoteSapo(RemoteRole):
    """The :class:`~async_rl.workers.sapo.SapoRole` calls the learner makes (spec §5), served by a
    :class:`SapoWorker` group: ``readouts``, ``update``, the weight export and
    checkpoints, and ``banned_token_ids`` for the rollout's sampling.

    Batches are collated dicts; the turn tensors and the frozen targets travel in the same DataProto as
    the batch (targets as ``target_<name>`` columns), padded for DP with zero-weight rows
    (:data:`SAPO_ZERO_WEIGHT_KEYS`). Every rank returns the global metrics (``SapoRole.update``
    all-reduces them), so the driver reads one.
    """

    def __init__(self, worker_group, reserved_ids: Sequence[int], timeout_s: Optional[float] = None):
        if len(tuple(reserved_ids)) != 2:
            raise ValueError(f"RemoteSapo needs the two reserved value ids (w+, w-), got {tuple(reserved_ids)}")
        super().__init__(worker_group, timeout_s)
        self.reserved_ids = tuple(int(i) for i in reserved_ids)

    export_weights = RemoteActor.export_weights  # a SapoWorker is an ActorWorker: the same weight calls
    publish_weights = RemoteActor.publish_weights

    @property
    def banned_token_ids(self) -> tuple[int, int]:
        """The rollout never samples the reserved ids (their logits are the V/Q readout)."""
        return self.reserved_ids

    def _padded_proto(self, batch, turns, targets=None, meta_info=None) -> tuple[DataProto, int]:
        data = dict(proto_to_batch(batch) if isinstance(batch, DataProto) else batch)
        data.update({key: turns[key] for key in SAPO_TURN_KEYS if key in turns})
        if targets is not None:
            data.update({f"target_{key}": value for key, value in targets.items() if torch.is_tensor(value)})
        return pad_proto_for_dp(batch_to_proto(data, meta_info), self.wg.world_size, zero_keys=SAPO_ZERO_WEIGHT_KEYS)

    def readouts(self, batch, num_turns: Optional[int] = None, timeout_s: Optional[float] = None
                 ) -> dict[str, torch.Tensor]:
        """The frozen old readouts of the whole batch (rows in batch order), as ``SapoRole.readouts``."""
        data = dict(proto_to_batch(batch) if isinstance(batch, DataProto) else batch)
        # K of the whole batch: a rank's shard may hold fewer turns, and the shards are joined again
        meta = {"num_turns": int(num_turns if num_turns is not None else num_turns_of(data["token_turn_index"]))}
        proto, added = pad_proto_for_dp(batch_to_proto(data, meta), self.wg.world_size,
                                        zero_keys=SAPO_ZERO_WEIGHT_KEYS)
        out = unpad(self.wg.compute_sapo_readouts(proto, **self._kw(timeout_s)), added)
        return {key[len("readout_"):]: out.batch[key] for key in out.batch.keys()}

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
