"""The transformers rollout engine as a verl rollout replica: ``RolloutReplicaRegistry.get("hf")``.

Registers our :class:`~async_rl.rollout.hf_engine.HFRolloutEngine` as ``"hf"`` next to verl's ``"vllm"`` /
``"sglang"``, so one driver (``async_rl.rollout.client.ReplicaPool``) serves all three engines.
:class:`HFRolloutServer` runs in its own Ray actor process (a decode thread owns the engine) and keeps verl's
server method names; its ``abort_all_requests`` pauses at a token boundary instead of dropping requests, so no
token is ever regenerated. :class:`VersionedTokenOutput` carries every token's version, which per-token
off-policy correction needs (spec §1). ``HFReplica`` is in :mod:`async_rl.rollout.replicas`.

Details: docs/rollout.md (7, "Registry", "In-flight weight update").
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from verl.workers.rollout.replica import TokenOutput

from async_rl.rollout.base import GenerationOutput, GenerationRequest, SamplingParams
from async_rl.rollout.checkpoint_engine import BACKEND_NAME, ObjectStoreCheckpointEngine
from async_rl.rollout.server_base import ReplicaBrokenError, ServerBookkeeping
from async_rl.rollout.settings import ENGINE_NAMES  # listed once, with the settings

# engines served by our own server classes (hf_engine / vllm_engine): pause keeps requests, per-token versions
OWN_SERVER_ENGINES = ("hf", "vllm")

# Sampling keys a server accepts (vLLM names where they exist) and what they become in SamplingParams.
_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "max_tokens": "max_new_tokens",
    "max_new_tokens": "max_new_tokens",
    "stop": "stop_strings",
    "stop_token_ids": "stop_token_ids",
    "banned_token_ids": "banned_token_ids",
    "seed": "seed",
    "ignore_eos": "ignore_eos",
}
# accepted and ignored: the engine always records the sampled token's log-prob and keeps a matched stop string
_IGNORED_SAMPLING_KEYS = ("logprobs", "include_stop_str_in_output", "detokenize")


# ``stop_detail`` (and the pool's ``GenerationOutput.stop_reason``) of an "aborted" reply the engine failed (vLLM's
# "error" finish): an engine fault on that one request, not a deliberate abort; the pool never resubmits it, counts
# it in ``rollout/engine_errors``, and its episode ends aborted (dropped from its group, never scored)
ENGINE_ERROR = "engine_error"


class VersionedTokenOutput(TokenOutput):
    """verl's ``TokenOutput`` plus what per-token off-policy training needs.

    ``log_probs[i]`` is the behaviour log-prob of ``token_ids[i]`` (see ``async_rl.rollout.base``) and
    ``versions[i]`` the policy version whose weights sampled it. ``stop_reason`` keeps verl's meaning
    ("completed" | "aborted"); ``finish_reason`` is the engine's ("stop" | "length" | "aborted") and
    ``stop_detail`` the matched stop string or token id, or :data:`ENGINE_ERROR` for a request the engine failed.
    """

    versions: list[int] = []
    finish_reason: str = "stop"
    stop_detail: Optional[str | int] = None
    text: str = ""


def sampling_from_server_dict(params: Mapping[str, Any]) -> SamplingParams:
    """verl/vLLM-style sampling dict -> :class:`SamplingParams`; unknown keys fail with the valid names."""
    kwargs: dict[str, Any] = {}
    for key, value in params.items():
        if key in _IGNORED_SAMPLING_KEYS:
            continue
        if key == "top_k" and value in (-1, 0, None):
            continue
        if key == "repetition_penalty" and value in (1, 1.0, None):
            continue
        if key not in _SAMPLING_KEYS:
            raise ValueError(f"sampling_params[{key!r}] is not supported by the hf engine; valid keys: "
                             f"{sorted(_SAMPLING_KEYS) + ['top_k=-1', 'repetition_penalty=1.0']}")
        name = _SAMPLING_KEYS[key]
        kwargs[name] = tuple(value) if name in ("stop_strings", "stop_token_ids", "banned_token_ids") else value
    return SamplingParams(**kwargs)


def sampling_to_server_dict(sampling: SamplingParams, engine: str, vocab_size: Optional[int] = None) -> dict:
    """:class:`SamplingParams` -> the dict a replica server of ``engine`` takes (vLLM names)."""
    params: dict[str, Any] = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                              "max_tokens": sampling.max_new_tokens, "ignore_eos": sampling.ignore_eos,
                              "logprobs": True}
    if sampling.seed is not None:
        params["seed"] = int(sampling.seed)
    if sampling.stop_strings:
        params["stop"] = list(sampling.stop_strings)
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    if engine == "hf":
        if sampling.banned_token_ids:
            params["banned_token_ids"] = list(sampling.banned_token_ids)
        return params
    # vLLM / SGLang: keep the stop string in the text as our engine does; bans become an allow-list
    params["include_stop_str_in_output"] = True
    if sampling.banned_token_ids:
        if vocab_size is None:
            raise ValueError("banned_token_ids on a vllm/sglang replica need the vocabulary size")
        banned = set(sampling.banned_token_ids)
        params["allowed_token_ids"] = [t for t in range(vocab_size) if t not in banned]
    return params


def first_stop_string(tokens: list[int], tokenizer: Any, stop_strings) -> Optional[tuple[int, str]]:
    """``(n, stop)``: the first ``n`` tokens are the shortest prefix whose decoded text contains a stop string
    (the token that completes it is kept, as in the hf engine); None if the text holds none."""
    if not stop_strings or not tokens:
        return None
    if not any(stop in tokenizer.decode(tokens, skip_special_tokens=True) for stop in stop_strings):
        return None
    for cut in range(1, len(tokens) + 1):
        head = tokenizer.decode(tokens[:cut], skip_special_tokens=True)
        hit = next((stop for stop in stop_strings if stop in head), None)
        if hit is not None:
            return cut, hit
    return None


def token_output_to_generation(request: GenerationRequest, out: TokenOutput, version_fallback: int,
                               tokenizer: Any = None) -> GenerationOutput:
    """A server's reply -> :class:`GenerationOutput`.

    Our servers (hf, vllm) reply with a :class:`VersionedTokenOutput`: per-token versions, text, finish reason.
    verl's own ``TokenOutput`` (its SGLang/vLLM servers) has none of these: every token gets the call's
    ``global_steps``; the text is decoded here with ``tokenizer``; a stop string found in it is honoured (tokens
    after the one that completes it are dropped, finish "stop"); else "aborted" stays aborted, a reply that used
    the whole ``max_new_tokens`` budget is "length", anything else "stop" (an eos or stop token)."""
    tokens = list(out.token_ids)
    logprobs = list(out.log_probs or [])
    if len(logprobs) != len(tokens):
        raise ValueError(f"request {request.request_id!r}: the server returned {len(tokens)} tokens but "
                         f"{len(logprobs)} log-probs; ask for them with sampling_params['logprobs']=True")
    versions = list(getattr(out, "versions", []) or [])
    if isinstance(out, VersionedTokenOutput) and len(versions) == len(tokens):
        return GenerationOutput(request_id=request.request_id, prompt_ids=list(request.prompt_ids), token_ids=tokens,
                                logprobs=logprobs, versions=versions, finish_reason=out.finish_reason,
                                text=out.text, stop_reason=out.stop_detail)
    version = (out.extra_fields or {}).get("global_steps", version_fallback)
    versions = [int(version_fallback if version is None else version)] * len(tokens)
    sampling = request.sampling
    if tokenizer is None:
        raise ValueError(f"request {request.request_id!r}: a plain TokenOutput carries no text; give the pool the "
                         f"tokenizer (ReplicaPool(tokenizer=...)) to decode it")
    text = tokenizer.decode(tokens, skip_special_tokens=True) if tokens else ""
    finish, stop_detail = None, None
    found = first_stop_string(tokens, tokenizer, sampling.stop_strings)
    if found is not None:
        cut, stop_detail = found
        tokens, logprobs, versions = tokens[:cut], logprobs[:cut], versions[:cut]
        text, finish = tokenizer.decode(tokens, skip_special_tokens=True), "stop"
    if finish is None:
        if out.stop_reason in ("aborted", "abort"):
            finish = "aborted"
        elif len(tokens) >= sampling.max_new_tokens:
            finish = "length"
        else:
            finish, stop_detail = "stop", (tokens[-1] if tokens else None)
    return GenerationOutput(request_id=request.request_id, prompt_ids=list(request.prompt_ids), token_ids=tokens,
                            logprobs=logprobs, versions=versions, finish_reason=finish, text=text,
                            stop_reason=stop_detail)


async def _receive_all(engine: Any, version: int) -> list[tuple[str, torch.Tensor]]:
    """Every ``(name, tensor)`` of one transfer, whether the engine yields them synchronously (the object store,
    read in a thread) or asynchronously (verl's NCCL engine)."""
    weights = engine.receive_weights(global_steps=version)
    if hasattr(weights, "__aiter__"):
        # an async engine reuses its receive bucket between chunks: copy each tensor out before the next one
        return [(name, tensor.detach().clone()) async for name, tensor in weights]
    return await asyncio.to_thread(lambda: list(weights))


def versioned_reply(output: GenerationOutput, replica_rank: int, current_version: int) -> VersionedTokenOutput:
    """An engine's :class:`GenerationOutput` as the server's reply (``global_steps``: the last token's version)."""
    return VersionedTokenOutput(
        token_ids=list(output.token_ids), log_probs=list(output.logprobs),
        stop_reason="aborted" if output.finish_reason == "aborted" else "completed",
        versions=list(output.versions), finish_reason=output.finish_reason, stop_detail=output.stop_reason,
        text=output.text,
        extra_fields={"global_steps": output.versions[-1] if output.versions else int(current_version),
                      "replica_rank": int(replica_rank)})


def empty_output(request: GenerationRequest) -> GenerationOutput:
    """A request ended "aborted" before its first token."""
    return GenerationOutput(request.request_id, list(request.prompt_ids), [], [], [], "aborted", "")


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
        weights = await _receive_all(source, int(version))
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


__all__ = ["BACKEND_NAME", "ENGINE_NAMES", "OWN_SERVER_ENGINES", "HFRolloutServer", "ReplicaBrokenError", "VersionedTokenOutput",
           "sampling_from_server_dict", "sampling_to_server_dict", "token_output_to_generation"]
