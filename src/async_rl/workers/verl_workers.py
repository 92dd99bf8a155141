"""The actor, critic and rollout roles as verl ``single_controller`` workers (Ray actors).

Each worker is a thin wrapper around :class:`~async_rl.workers.roles.ActorRole`,
:class:`~async_rl.workers.roles.CriticRole` or :class:`~async_rl.rollout.hf_engine.HFRolloutEngine`: it
adds the process group, verl's ``@register`` dispatch modes and the ``DataProto`` conversion, with
zero-weight padding for data parallelism (:func:`pad_proto_for_dp`). This module gathers in one place the
public names of :mod:`~async_rl.workers.calls` (:class:`TimedRayWorkerGroup`, :class:`WorkerCallError`),
``proto``, ``worker_base``, ``train_workers``, ``rollout_worker``, ``sapo_worker`` and ``remote`` (all in
:mod:`async_rl.workers`); placement is in :mod:`async_rl.workers.placement`.

Details: docs/architecture.md (§1 The workers: the method table, "Data parallelism through verl's
dispatch", "Bounded calls and errors").
"""

from async_rl.workers.calls import (DEFAULT_CALL_TIMEOUT_S, TimedRayWorkerGroup, WorkerCallError, WorkerTimeoutError,
                                    wait_for_workers)
from async_rl.workers.proto import (ACTOR_UPDATE_KEYS, CRITIC_UPDATE_KEYS, MODEL_INPUT_KEYS, SAPO_TURN_KEYS,
                                    ZERO_WEIGHT_KEYS, batch_to_proto, metrics_from_proto, pad_proto_for_dp,
                                    proto_to_batch)
from async_rl.workers.remote import SAPO_ZERO_WEIGHT_KEYS, RemoteActor, RemoteCritic, RemoteSapo
from async_rl.workers.rollout_worker import (GENERATION_COLUMNS, RolloutWorker, outputs_from_proto, outputs_to_proto,
                                             requests_from_dicts, requests_from_proto)
from async_rl.workers.sapo_worker import SapoWorker
from async_rl.workers.train_workers import ActorWorker, CriticWorker

__all__ = [
    "ACTOR_UPDATE_KEYS", "CRITIC_UPDATE_KEYS", "DEFAULT_CALL_TIMEOUT_S", "GENERATION_COLUMNS", "MODEL_INPUT_KEYS",
    "ActorWorker", "CriticWorker", "RemoteActor", "RemoteCritic", "RemoteSapo", "RolloutWorker", "SAPO_TURN_KEYS",
    "SAPO_ZERO_WEIGHT_KEYS", "SapoWorker", "TimedRayWorkerGroup", "ZERO_WEIGHT_KEYS",
    "WorkerCallError", "WorkerTimeoutError", "batch_to_proto", "metrics_from_proto", "outputs_from_proto",
    "outputs_to_proto", "pad_proto_for_dp", "proto_to_batch", "requests_from_dicts", "requests_from_proto",
    "wait_for_workers",
]
