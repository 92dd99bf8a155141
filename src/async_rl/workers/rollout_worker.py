"""The rollout engine fused into a train rank (``RolloutWorker``): what serves a ``rollout.mode=hybrid`` replica.

Each train rank of the colocated placement holds one; the rank's :class:`~async_rl.rollout.servers.hybrid.HybridServer`
calls its ``hybrid_*`` methods one at a time, so generation and training take turns on the rank's device
(docs/rollout.md §8). New weights come from the fused actor in memory, never through Ray.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from verl.single_controller.base.decorator import Dispatch, register

from async_rl.engine import dist
from async_rl.workers.worker_base import RoleWorker


class RolloutWorker(RoleWorker):
    """One rollout engine fused with an :class:`~async_rl.workers.train_workers.ActorWorker` (or SAPO's worker) in a
    train rank's process: :class:`~async_rl.rollout.hf_engine.HFRolloutEngine` (``engine="hf"``) or vLLM stepped in
    this process's child (``engine="vllm"``, :class:`~async_rl.rollout.vllm_stepped.VLLMSteppedEngine`).

    The engine holds its own copy of the weights: running the actor's own module, it could not finish a request
    under version v once the trainer has changed the module in place, yet Li2SAO's switch must receive the
    prefetched job before it publishes v + 1 (spec §4); verl's hybrid engine keeps its own copy for the same reason.
    A new version is copied from the actor in memory (:meth:`_copy_actor_weights`: an all-gather among the train
    ranks when the actor is sharded, nothing through Ray).
    """

    def __init__(self, model_path: str, dtype: Optional[str] = None, torch_threads: Optional[int] = 1,
                 device: Optional[str] = None, initial_version: int = 0, engine: str = "hf",
                 engine_options: Optional[dict] = None):
        super().__init__(torch_threads=torch_threads, device=device)
        if engine not in ("hf", "vllm"):
            raise ValueError(f"RolloutWorker engine={engine!r}; valid choices: hf, vllm")
        self.engine_name = engine
        self.engine_options = dict(engine_options or {})
        self.model_path = str(model_path)
        self.dtype = dtype
        self.initial_version = initial_version
        self.engine = None
        self._hybrid_held: list = []  # requests that arrived while asleep (admitted at wake-up)
        self._hybrid_sleeping = False

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        """Build the engine with the fused actor's current weights; call it after the actor's ``init_model``."""
        from async_rl.models.loading import load_causal_lm, load_tokenizer
        from async_rl.rollout.hf_engine import HFRolloutEngine

        actor = self._sibling("actor")
        if actor is None or actor.role is None:
            raise RuntimeError("RolloutWorker.init_model: the worker is fused with a train rank "
                               "(make_worker_groups('colocated', ...)); initialise the actor first")
        device = torch.device("cpu") if self.device_type == "cpu" else dist.current_device()
        if self.engine_name == "vllm":
            from async_rl.rollout.vllm_stepped import VLLMSteppedEngine

            self.engine = VLLMSteppedEngine(self.model_path, device=torch.device(device).type,
                                            initial_version=self.initial_version,
                                            engine_options={"dtype": self.dtype, **self.engine_options})
        else:
            model = load_causal_lm(self.model_path, dtype=self.dtype, device="cpu")
            self.engine = HFRolloutEngine(model, load_tokenizer(self.model_path), device=device,
                                          initial_version=self.initial_version)
        self._copy_actor_weights(self.initial_version)  # the actor may differ from the checkpoint (rank 0 broadcast)
        return {"rank": self.rank, "device": str(device), "version": self.engine.policy_version}

    def _require_engine(self):
        if self.engine is None:
            raise RuntimeError(f"{type(self).__name__} rank {self.rank}: call init_model() first")

    def _copy_actor_weights(self, version: int) -> int:
        """Take the fused actor's current weights as policy ``version`` (in memory; an all-gather when sharded)."""
        self.engine.update_weights(self._sibling("actor").role.engine.full_state_dict(), int(version))
        return self.engine.policy_version

    # ---------------------------------------------------------------- rollout.mode=hybrid (docs/rollout.md §8)
    # Called one at a time by this rank's HybridServer (async_rl.rollout.servers.hybrid) through the fused worker's
    # ``_fuw_execute``; the worker's actor queue serialises them with the training calls, so generation and
    # training take turns on the shared device. Not worker-group methods: each rank serves its own replica.

    def hybrid_info(self) -> dict[str, Any]:
        """Where the engine runs (read by :class:`~async_rl.rollout.replicas.HybridReplica` at start)."""
        self._require_engine()
        return {"pid": os.getpid(), "rank": self.rank, "device": str(self.engine.device),
                "version": self.engine.policy_version, "engine": self.engine_name}

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
        from async_rl.rollout.wire import empty_output

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
        memory, :meth:`_copy_actor_weights`; unfinished requests are re-prefilled under them); without one the engine
        goes on with the version it holds."""
        self._require_engine()
        if version is not None:
            self._copy_actor_weights(int(version))
        self._hybrid_sleeping = False
        return {"version": self.engine.policy_version,
                "num_unfinished": self.engine.num_unfinished + len(self._hybrid_held)}

    def hybrid_progress(self) -> list[dict]:
        """Tokens, log-probs and versions generated so far by every unfinished request (read between chunks)."""
        self._require_engine()
        return self.engine.export_inflight()
