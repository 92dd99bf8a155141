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

**Data.** The driver's collated batch (:func:`async_rl.driver.batch.collate`) travels as a verl
``DataProto``: tensors in ``.batch``, per-row python objects in ``.non_tensor_batch``, settings and
metrics in ``.meta_info`` (:func:`batch_to_proto`, :func:`proto_to_batch`). Under DP every rank must
get the same number of rows (FSDP collectives run once per micro-batch, in lock-step), so the driver
helpers pad a batch to a multiple of the world size with **zero-weight rows**
(:func:`pad_proto_for_dp`) -- unlike verl's auto-padding, which repeats real rows and would change a
training step -- and drop the padded rows from the outputs.

**Modules.** :mod:`~async_rl.workers.calls` (bounded calls: errors, :class:`TimedRayWorkerGroup`),
:mod:`~async_rl.workers.proto` (DataProto conversion and DP padding), :mod:`~async_rl.workers.worker_base`,
:mod:`~async_rl.workers.train_workers` (``ActorWorker``, ``CriticWorker``), :mod:`~async_rl.workers.rollout_worker`,
:mod:`~async_rl.workers.sapo_worker` and :mod:`~async_rl.workers.remote` (the driver-side adapters). This module
gathers their public names in one place.

**Bounded calls.** Worker groups built by :mod:`async_rl.workers.placement` are
:class:`TimedRayWorkerGroup` s: every registered method waits at most ``timeout_s`` (a per-call
keyword, else the group's ``call_timeout_s``). A worker that raises surfaces at the driver as a
:class:`WorkerCallError` naming the method, the worker and the cause, as soon as that worker fails
(not after the slowest rank); a call that does not finish in time raises :class:`WorkerTimeoutError`.
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
