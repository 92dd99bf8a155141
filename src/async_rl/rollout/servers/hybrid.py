"""``rollout.mode=hybrid``: the rollout engine inside the training processes, behind verl's server methods.

As in verl's hybrid engine (``RolloutMode.HYBRID``, ``RolloutReplica.init_hybrid(worker_group)``), rollout and
training share each train rank's process and device and take turns. The engine is the
:class:`~async_rl.workers.rollout_worker.RolloutWorker` role fused with the actor (its ``hybrid_*`` methods): the hf
engine, or vLLM stepped from the rank (:class:`~async_rl.rollout.vllm_stepped.VLLMSteppedEngine`, its engine core a
child process of the rank), with its own weight copy refreshed from the rank's memory at each publication. The
server, :class:`HybridServer` (one small
async Ray actor per rank), has the standalone server's methods, so
:class:`~async_rl.rollout.pool.ReplicaPool` and both schedulers drive it unchanged; it pumps the engine one
chunk per call. Tokens sampled between an update and its publication keep the old version, as Li2SAO's switch
needs (spec §4).

Details: docs/rollout.md (8. rollout.mode=hybrid).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Optional

from async_rl.rollout.base import GenerationOutput, GenerationRequest
from async_rl.rollout.servers.base import ReplicaBrokenError, ServerBookkeeping
from async_rl.rollout.wire import VersionedTokenOutput, empty_output, sampling_from_server_dict, versioned_reply

# the fused worker's name for a RolloutWorker method: verl's "{role}_fwmn_{method}" (fused worker method name)
ROLLOUT_METHOD_PREFIX = "rollout_fwmn_"


class HybridServer(ServerBookkeeping):
    """verl rollout-server methods for the engine fused into train rank ``replica_rank`` (a Ray async actor).

    Args:
        worker: the train rank's fused worker (an actor handle with verl's ``_fuw_execute``).
        replica_rank: this replica's index (= the train rank).
        chunk_tokens: tokens decoded per call into the worker; a pause, an abort or a new request waits at most
            one chunk.
    """

    def __init__(self, worker, replica_rank: int = 0, chunk_tokens: int = 4) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.worker = worker
        self._init_bookkeeping(replica_rank, extra_counters=("chunks", "sleeps"))
        self.chunk_tokens = int(chunk_tokens)
        self._queued: list[GenerationRequest] = []  # not yet sent to the worker
        self._futures: dict[Any, asyncio.Future] = {}  # request id -> its generate() call
        self._worker_lock = asyncio.Lock()  # one call into the worker at a time
        self._kick = asyncio.Event()
        self._rejecting = False
        self._asleep = False  # as the worker last reported
        self._num_unfinished = 0  # held by the worker, as it last reported
        self._version = 0
        self._stopped = False
        self._pump_task: Optional[asyncio.Task] = None
        self._start: Optional[asyncio.Task] = None
        self._info: dict[str, Any] = {}

    async def _call(self, method: str, *args: Any) -> Any:
        """One call into the worker's RolloutWorker; a failure breaks this replica (every waiter is failed)."""
        self._raise_if_broken()
        try:
            return await self.worker._fuw_execute.remote(ROLLOUT_METHOD_PREFIX + method, *args)
        except BaseException as error:
            lines = [line for line in str(error).splitlines() if line.strip()]
            self._break(f"{type(error).__name__} in {method}: {lines[-1] if lines else error!r}")
            raise ReplicaBrokenError(self._broken_message()) from error

    async def _ensure_started(self) -> None:
        """Read the engine's pid, device and version once, then start the pump (concurrent first calls share it)."""
        if self._start is None:
            self._start = asyncio.get_running_loop().create_task(self._start_once())
        await asyncio.shield(self._start)

    async def _start_once(self) -> None:
        async with self._worker_lock:
            self._info = await self._call("hybrid_info")
        self._version = int(self._info["version"])
        self._pump_task = asyncio.get_running_loop().create_task(self._pump())

    # ------------------------------------------------------------------ verl server interface
    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       **unsupported: Any) -> VersionedTokenOutput:
        """Token-in/token-out generation of one request; returns when it finishes (or is aborted)."""
        if any(value is not None for value in unsupported.values()):
            raise ValueError(f"the hybrid replica takes no multimodal/priority inputs; got {sorted(unsupported)}")
        request = GenerationRequest(request_id, [int(t) for t in prompt_ids], sampling_from_server_dict(sampling_params))
        await self._ensure_started()
        self._raise_if_broken()
        if self._rejecting:
            return versioned_reply(empty_output(request), self.replica_rank, self._version)
        if request_id in self._futures:
            raise ValueError(f"request_id {request_id!r} is already running on replica {self.replica_rank}")
        future = asyncio.get_running_loop().create_future()
        self._futures[request_id] = future
        self._queued.append(request)
        self.counters["requests"] += 1
        self._kick.set()
        output: GenerationOutput = await future
        return versioned_reply(output, self.replica_rank, self._version)

    async def abort_all_requests(self, reject_request: bool = False, reset_prefix_cache: bool = True) -> dict:
        """Pause at the next chunk boundary, keeping every request and its tokens (as the standalone hf server)."""
        await self._ensure_started()
        self._paused, self._rejecting = True, bool(reject_request)
        async with self._worker_lock:  # the chunk in progress finishes first
            live = len(self._futures)
        self.counters["paused_requests"] += live
        return {"aborted_count": 0, "paused_count": live, "request_ids": []}

    async def resume_generation(self) -> None:
        self._paused = self._rejecting = False
        self._kick.set()

    async def update_weights(self, published: Any, version: int) -> dict[str, float]:
        """Wake the engine under policy ``version``: it takes the fused actor's current weights in memory
        (``published``, the handle the standalone replicas load, is not needed here and is not read)."""
        await self._ensure_started()
        started = time.perf_counter()
        async with self._worker_lock:
            reply = await self._call("hybrid_wake_up", int(version))
        self._version, self._asleep = int(reply["version"]), False
        self.counters["weight_updates"] += 1
        self.last_update_s = time.perf_counter() - started
        self._kick.set()
        return {"fetch_s": 0.0, "load_s": self.last_update_s, "version": self._version}

    async def sleep(self) -> None:
        """Stop decoding and free the engine's KV cache (requests keep their tokens) until :meth:`wake_up`."""
        await self._ensure_started()
        async with self._worker_lock:
            await self._call("hybrid_sleep")
        self._asleep = True
        self.counters["sleeps"] += 1

    async def wake_up(self) -> None:
        """Resume decoding with the weights last synced (a new version comes through :meth:`update_weights`)."""
        await self._ensure_started()
        async with self._worker_lock:
            reply = await self._call("hybrid_wake_up", None)
        self._version, self._asleep = int(reply["version"]), False
        self._kick.set()

    async def abort_requests(self, request_ids: list[Any]) -> dict[str, Any]:
        """Finish these requests as "aborted" (their ``generate`` calls return what they have)."""
        await self._ensure_started()
        wanted = set(request_ids)
        queued = [r for r in self._queued if r.request_id in wanted]
        self._queued = [r for r in self._queued if r.request_id not in wanted]
        for request in queued:
            self._deliver(empty_output(request))
        sent = [rid for rid in wanted if rid in self._futures]
        outputs: list[GenerationOutput] = []
        if sent:
            async with self._worker_lock:
                outputs = await self._call("hybrid_abort", sent)
            for output in outputs:
                self._deliver(output)
        return {"aborted_count": len(queued) + len(outputs),
                "request_ids": [r.request_id for r in queued] + [o.request_id for o in outputs]}

    async def progress(self) -> dict[Any, dict[str, list]]:
        """Tokens, log-probs and versions of every unfinished request, read between chunks."""
        await self._ensure_started()
        async with self._worker_lock:
            states = await self._call("hybrid_progress")
        return {state["request_id"]: self._progress_entry(state["token_ids"], state["logprobs"], state["versions"])
                for state in states}

    async def ping(self) -> dict[str, Any]:
        """Health and progress (``pid``: the train rank's process, where the engine runs)."""
        await self._ensure_started()
        self._raise_if_broken()
        return {**self._ping_fields(self._info.get("pid"), self._version, len(self._futures), self._info.get("device")),
                "server_pid": os.getpid(), "mode": "hybrid", "asleep": self._asleep, "engine": self._info.get("engine")}

    async def get_pid(self) -> int:
        await self._ensure_started()
        return int(self._info["pid"])

    async def shutdown(self) -> None:
        self._stopped = True
        self._kick.set()

    # ------------------------------------------------------------------ the pump
    def _has_work(self) -> bool:
        return bool(self._queued) or self._num_unfinished > 0

    async def _pump(self) -> None:
        """Feed queued requests to the worker and decode one chunk per call while awake, unpaused and busy."""
        while not self._stopped:
            await self._kick.wait()
            self._kick.clear()
            while not self._stopped and not self._paused and self._has_work() and self._broken is None:
                async with self._worker_lock:
                    if self._paused:
                        break
                    sending, self._queued = self._queued, []
                    try:
                        reply = await self._call("hybrid_step", sending, self.chunk_tokens)
                    except ReplicaBrokenError:
                        return
                self.counters["chunks"] += 1
                for request_id, message in reply["errors"].items():
                    future = self._futures.pop(request_id, None)
                    if future is not None and not future.done():
                        future.set_exception(ValueError(message))
                for output in reply["outputs"]:
                    self._deliver(output)
                self._version, self._num_unfinished = int(reply["version"]), int(reply["num_unfinished"])
                self._asleep = bool(reply["asleep"])
                if self._asleep:
                    break  # nothing moves until a wake-up (update_weights / wake_up) kicks the pump again
                await asyncio.sleep(0)  # let generate / control calls in between two chunks

    def _deliver(self, output: GenerationOutput) -> None:
        future = self._futures.pop(output.request_id, None)
        self._count_delivered(output)
        if future is not None and not future.done():
            future.set_result(output)

    def _break(self, reason: str) -> None:
        if self._broken is not None:
            return
        self._broken = f"its train worker failed: {reason}"
        error = ReplicaBrokenError(self._broken_message())
        for future in self._futures.values():
            if not future.done():
                future.set_exception(error)
        self._futures.clear()
        self._queued = []

    def describe(self) -> str:
        return (f"hybrid {self._info.get('engine', '')} replica {self.replica_rank} (train rank pid "
                f"{self._info.get('pid')})").replace("  ", " ")


__all__ = ["HybridServer", "ROLLOUT_METHOD_PREFIX"]
