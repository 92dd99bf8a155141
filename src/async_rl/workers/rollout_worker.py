"""The hf rollout engine as a verl worker (``RolloutWorker``): generation split over workers, weight updates.

Requests travel as a ``DataProto`` or a list of request dicts (:func:`dispatch_requests`, :func:`collect_outputs`);
in the colocated placement the worker shares its process with a train rank (``sync_from_actor``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import ray
import torch
from verl.protocol import DataProto
from verl.single_controller.base.decorator import Dispatch, register

from async_rl.engine import dist
from async_rl.workers.proto import object_array
from async_rl.workers.worker_base import RoleWorker


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
    columns = {c: object_array([getattr(o, c) for o in outputs]) for c in GENERATION_COLUMNS}
    return DataProto(batch=None, non_tensor_batch=columns, meta_info=dict(meta_info or {}))


def outputs_from_proto(proto: DataProto):
    """The inverse of :func:`outputs_to_proto`: a list of ``GenerationOutput``."""
    from async_rl.rollout.base import GenerationOutput

    cols = proto.non_tensor_batch
    return [GenerationOutput(**{c: (list(cols[c][i]) if c in ("prompt_ids", "token_ids", "logprobs", "versions")
                                    else cols[c][i]) for c in GENERATION_COLUMNS})
            for i in range(len(proto))]


class RolloutWorker(RoleWorker):
    """One rollout engine per worker: :class:`HFRolloutEngine` (``engine="hf"``) or vLLM stepped in this process's
    child (``engine="vllm"``, :class:`~async_rl.rollout.vllm_stepped.VLLMSteppedEngine`, always its own weights).

    Disaggregated: the engine loads its own weights and receives new ones through
    :meth:`update_weights` (a state dict or an object-store ref, with the policy version).
    Colocated (fused with an :class:`ActorWorker` in the same process): with an unsharded actor
    (world size 1) the engine runs **the actor's own module** (no copy at all); with a sharded actor
    the full weights are gathered in-process by :meth:`sync_from_actor` (an all-gather among the train
    ranks, nothing through Ray) and copied into the engine's model.
    """

    def __init__(self, model_path: str, dtype: Optional[str] = None, torch_threads: Optional[int] = 1,
                 device: Optional[str] = None, share_actor_weights: bool = True, initial_version: int = 0,
                 engine: str = "hf", engine_options: Optional[dict] = None):
        super().__init__(torch_threads=torch_threads, device=device)
        if engine not in ("hf", "vllm"):
            raise ValueError(f"RolloutWorker engine={engine!r}; valid choices: hf, vllm")
        self.engine_name = engine
        self.engine_options = dict(engine_options or {})
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
        if self.engine_name == "vllm":
            from async_rl.rollout.vllm_stepped import VLLMSteppedEngine

            self.mode = "colocated-copy" if actor is not None else "own-weights"
            self.engine = VLLMSteppedEngine(self.model_path, device=torch.device(device).type,
                                            initial_version=self.initial_version,
                                            engine_options={"dtype": self.dtype, **self.engine_options})
        elif actor is not None and self.share_actor_weights and not actor.role.engine.is_sharded:
            model, self.mode = actor.role.engine.module, "shared-module"
            device = actor.role.engine.device
        else:
            model = load_causal_lm(self.model_path, dtype=self.dtype, device="cpu")
            self.mode = "colocated-copy" if actor is not None else "own-weights"
        if self.engine is None:
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
    # Called one at a time by this rank's HybridServer (async_rl.rollout.hybrid) through the fused worker's
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
