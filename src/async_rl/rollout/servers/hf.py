"""The transformers rollout engine's server: :class:`HFRolloutServer`, the process behind an ``"hf"`` replica.

Our :class:`~async_rl.rollout.hf_engine.HFRolloutEngine`, registered in verl as ``"hf"`` next to ``"vllm"`` /
``"sglang"`` (``RolloutReplicaRegistry.get("hf")`` is :class:`~async_rl.rollout.replicas.HFReplica`), so one pool
(:class:`~async_rl.rollout.pool.ReplicaPool`) serves every engine. The server runs in its own Ray actor process
(a decode thread owns the engine) and keeps verl's server method names; its ``abort_all_requests`` pauses at a
token boundary instead of dropping requests, so no token is ever regenerated. Replies are
:class:`~async_rl.rollout.wire.VersionedTokenOutput` s.

Details: docs/rollout.md (7, "Registry", "In-flight weight update").
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any, Callable, Optional

import torch

from async_rl.rollout.base import GenerationOutput, GenerationRequest
from async_rl.rollout.checkpoint_engine import BACKEND_NAME, ObjectStoreCheckpointEngine
from async_rl.rollout.servers.base import ReplicaBrokenError, ServerBookkeeping
from async_rl.rollout.wire import VersionedTokenOutput, empty_output, receive_all_weights, sampling_from_server_dict, \
    versioned_reply


class HFRolloutServer(ServerBookkeeping):
    """One :class:`HFRolloutEngine` behind verl's rollout-server methods (run as a Ray async actor).

    Args:
        model_path: local HF checkpoint directory.
        replica_rank: this replica's index (shown in errors and metrics).
        device: "cpu" or "cuda" (Ray sets CUDA_VISIBLE_DEVICES, so "cuda" is this actor's GPU).
        dtype: model dtype when loading (None = checkpoint dtype).
        torch_threads: intra-op threads of this process on CPU (None = torch default).
        chunk_tokens: tokens per decode chunk; control commands and new requests wait at most one chunk.
        initial_version: policy version of the weights in ``model_path``.
    """

    def __init__(self, model_path: str, replica_rank: int = 0, device: str = "cpu", dtype: Optional[str] = None,
                 torch_threads: Optional[int] = 1, chunk_tokens: int = 4, initial_version: int = 0,
                 checkpoint_backend: str = BACKEND_NAME, checkpoint_bucket_megabytes: int = 2048) -> None:
        from async_rl.rollout.hf_engine import HFRolloutEngine

        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        if torch_threads:
            torch.set_num_threads(int(torch_threads))
        self._init_bookkeeping(replica_rank)
        self.chunk_tokens = int(chunk_tokens)
        self.engine = HFRolloutEngine(str(model_path), device=device, dtype=dtype, initial_version=initial_version)
        # published handles from the pool's own update always come through the object store; verl's
        # CheckpointEngineManager drives self.checkpoint_engine (the configured backend, e.g. NCCL on GPU)
        self._handle_engine = ObjectStoreCheckpointEngine()
        if checkpoint_backend == BACKEND_NAME:
            self.checkpoint_engine = ObjectStoreCheckpointEngine()
        else:
            from verl.checkpoint_engine.base import CheckpointEngineRegistry

            self.checkpoint_engine = CheckpointEngineRegistry.new(checkpoint_backend, is_master=False,
                                                                  bucket_size=int(checkpoint_bucket_megabytes) << 20)
        self._cond = threading.Condition()
        self._incoming: list[tuple[GenerationRequest, asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._waiting: dict[Any, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._commands: list[tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._rejecting = False
        self._stopped = False
        self._last_iteration = time.monotonic()
        self._thread = threading.Thread(target=self._decode_loop, name=f"hf-replica-{replica_rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ verl server interface
    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       **unsupported: Any) -> VersionedTokenOutput:
        """Token-in/token-out generation of one request; returns when it finishes (or is aborted)."""
        if any(value is not None for value in unsupported.values()):
            raise ValueError(f"the hf replica has no multimodal/priority inputs; got {sorted(unsupported)}")
        request = GenerationRequest(request_id, [int(t) for t in prompt_ids],
                                    sampling_from_server_dict(sampling_params))
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            self._raise_if_broken()
            if self._rejecting:
                return self._aborted_reply(request)
            if request_id in self._waiting or any(r.request_id == request_id for r, _, _ in self._incoming):
                raise ValueError(f"request_id {request_id!r} is already running on replica {self.replica_rank}")
            if not self._incoming and not self._waiting and not self._commands:
                self._last_iteration = time.monotonic()  # the loop was idle: its stall clock starts now
            self._incoming.append((request, loop, future))
            self.counters["requests"] += 1
            self._cond.notify_all()
        output: GenerationOutput = await future
        return self._reply(output)

    async def abort_all_requests(self, reject_request: bool = False, reset_prefix_cache: bool = True) -> dict:
        """Pause at the next token boundary, keeping every live request and its tokens (verl's partial
        rollout inside the server; see the module docstring). ``reject_request``: requests arriving while
        paused are answered "aborted" at once instead of waiting for :meth:`resume_generation`."""
        def pause() -> dict:
            self._paused, self._rejecting = True, bool(reject_request)
            live = self.engine.num_unfinished
            self.counters["paused_requests"] += live
            return {"aborted_count": 0, "paused_count": live, "request_ids": []}
        return await self._run_in_decode_thread(pause)

    async def resume_generation(self) -> None:
        with self._cond:
            self._paused = self._rejecting = False
            self._cond.notify_all()

    async def update_weights(self, published: Optional[dict[str, Any]] = None, version: Optional[int] = None,
                             global_steps: Optional[int] = None) -> dict[str, float]:
        """Load new weights and tag later tokens with their version; applied at a token boundary, unfinished
        requests keep their tokens and are re-prefilled under the new weights.

        ``update_weights(published, version)``: the pool's own update, a published handle
        (``{"version", "ref": [ObjectRef]}``) read through the object store. ``update_weights(global_steps=v)``:
        verl's ``CheckpointEngineWorker`` call, made by ``CheckpointEngineManager`` after it built the
        checkpoint engine's topology (``execute_checkpoint_engine``); the weights arrive from the actor ranks
        through the configured backend."""
        started = time.perf_counter()
        if published is not None:
            if version is None:
                raise ValueError("update_weights(published, version): give the version the handle holds")
            source = self._handle_engine
            source.set_source(published)
        elif global_steps is not None:
            source, version = self.checkpoint_engine, int(global_steps)
        else:
            raise ValueError("update_weights needs a published handle and its version, or global_steps=")
        weights = await receive_all_weights(source, int(version))
        fetched = time.perf_counter()

        def load() -> None:
            self.engine.update_weights(weights, int(version))
        await self._run_in_decode_thread(load)
        if source is self._handle_engine:
            source.finalize()
        self.counters["weight_updates"] += 1
        self.last_update_s = time.perf_counter() - started
        return {"fetch_s": fetched - started, "load_s": time.perf_counter() - fetched, "version": int(version)}

    async def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """verl's ``CheckpointEngineWorker.execute_checkpoint_engine``: the server is its own checkpoint-engine
        worker, because this engine loads weights in its own process."""
        result = getattr(self.checkpoint_engine, method)(*args, **kwargs)
        return await result if asyncio.iscoroutine(result) else result

    async def release_kv_cache(self) -> None:
        """Free the KV cache at the next token boundary (requests keep their tokens; re-prefilled on resume)."""
        await self._run_in_decode_thread(self.engine.release_cache)

    async def resume_kv_cache(self) -> None:
        """Nothing to allocate: the KV cache is rebuilt by the next prefill."""

    async def abort_requests(self, request_ids: list[Any]) -> dict[str, Any]:
        """Finish these requests as "aborted" (their ``generate`` calls return what they have)."""
        wanted = set(request_ids)

        def abort() -> dict[str, Any]:
            with self._cond:  # generate() appends to _incoming from the event loop thread
                queued = [entry for entry in self._incoming if entry[0].request_id in wanted]
                self._incoming = [entry for entry in self._incoming if entry[0].request_id not in wanted]
            for request, loop, future in queued:  # not admitted yet: aborted before its first token
                self.counters["aborted"] += 1
                self._resolve(loop, future, self._empty_output(request))
            outputs = self.engine.abort([rid for rid in wanted if rid in self._waiting]) \
                if self.engine.has_unfinished else []
            for output in outputs:
                self._deliver(output)
            return {"aborted_count": len(queued) + len(outputs),
                    "request_ids": [r.request_id for r, _, _ in queued] + [o.request_id for o in outputs]}
        return await self._run_in_decode_thread(abort)

    async def progress(self) -> dict[Any, dict[str, list]]:
        """Tokens, log-probs and versions generated so far by every unfinished request, read at a token
        boundary (for monitoring, benchmarks and tests: while paused it is exactly the prefix that resumes)."""
        def read() -> dict[Any, dict[str, list]]:
            return {state["request_id"]: self._progress_entry(state["token_ids"], state["logprobs"], state["versions"])
                    for state in self.engine.export_inflight()}
        return await self._run_in_decode_thread(read)

    async def ping(self) -> dict[str, Any]:
        """Health and progress. ``stalled_s``: how long the decode loop has gone without finishing an iteration
        while it had work (0 when idle or paused) -- the event loop answers pings even when the decode thread
        is stuck, so this is what tells a hung engine from a busy one."""
        with self._cond:
            self._raise_if_broken()
            busy = bool(self._commands) or (not self._paused and (bool(self._incoming) or bool(self._waiting)))
            return self._ping_fields(os.getpid(), self.engine.policy_version,
                                     len(self._waiting) + len(self._incoming), str(self.engine.device),
                                     stalled_s=time.monotonic() - self._last_iteration if busy else 0.0)

    def get_pid(self) -> int:
        return os.getpid()

    # ------------------------------------------------------------------ decode thread
    def _decode_loop(self) -> None:
        try:
            while True:
                self._last_iteration = time.monotonic()  # heartbeat for ping()'s stalled_s
                with self._cond:
                    while not self._stopped and not self._commands and (
                            self._paused or (not self._incoming and not self.engine.has_unfinished)):
                        self._cond.wait()
                        self._last_iteration = time.monotonic()  # idle time is not a stall
                    if self._stopped:
                        return
                    commands, self._commands = self._commands, []
                for command, loop, future in commands:
                    try:
                        self._resolve(loop, future, command())
                    except BaseException as error:  # reported to the caller, the loop goes on
                        self._resolve(loop, future, error, failed=True)
                with self._cond:
                    if self._paused:
                        continue
                    admitted, self._incoming = self._incoming, []
                if admitted:
                    self._admit(admitted)
                if self.engine.has_unfinished:
                    for output in self.engine.step(self.chunk_tokens):
                        self._deliver(output)
        except BaseException as error:  # the replica is broken: fail every waiter, never hang them
            import traceback

            with self._cond:
                self._broken = f"its decode loop failed: {type(error).__name__}: {error}\n{traceback.format_exc()}"
                waiters = list(self._waiting.values()) + [(loop, fut) for _, loop, fut in self._incoming] + \
                    [(loop, fut) for _, loop, fut in self._commands]
                self._waiting.clear()
                self._incoming, self._commands = [], []
            for loop, future in waiters:
                self._resolve(loop, future, ReplicaBrokenError(self._broken_message()), failed=True)

    def _admit(self, admitted: list[tuple[GenerationRequest, asyncio.AbstractEventLoop, asyncio.Future]]) -> None:
        for request, loop, future in admitted:
            self._waiting[request.request_id] = (loop, future)
        try:
            self.engine.add_requests([request for request, _, _ in admitted])
            return
        except ValueError:
            pass  # one bad request must not fail the others: admit them one by one below
        for request, loop, future in admitted:
            try:
                self.engine.add_requests([request])
            except ValueError as error:
                self._waiting.pop(request.request_id, None)
                self._resolve(loop, future, error, failed=True)

    def _deliver(self, output: GenerationOutput) -> None:
        waiter = self._waiting.pop(output.request_id, None)
        self._count_delivered(output)
        if waiter is not None:
            self._resolve(waiter[0], waiter[1], output)

    @staticmethod
    def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value: Any, failed: bool = False) -> None:
        def settle() -> None:
            if future.done():
                return
            if failed:
                future.set_exception(value)
            else:
                future.set_result(value)
        loop.call_soon_threadsafe(settle)

    async def _run_in_decode_thread(self, command: Callable[[], Any]) -> Any:
        """Run ``command`` in the decode thread between two chunks (a token boundary)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            self._raise_if_broken()
            if not self._incoming and not self._waiting and not self._commands:
                self._last_iteration = time.monotonic()  # the loop was idle: its stall clock starts now
            self._commands.append((command, loop, future))
            self._cond.notify_all()
        return await future

    def describe(self) -> str:
        return f"hf replica {self.replica_rank} (pid {os.getpid()})"

    _empty_output = staticmethod(empty_output)

    def _aborted_reply(self, request: GenerationRequest) -> VersionedTokenOutput:
        return self._reply(self._empty_output(request))

    def _reply(self, output: GenerationOutput) -> VersionedTokenOutput:
        return versioned_reply(output, self.replica_rank, self.engine.policy_version)

    async def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()


__all__ = ["HFRolloutServer"]
