"""vLLM's side of the rollout, shared by both vLLM engines (the replica server :mod:`async_rl.rollout.servers.vllm`
and the hybrid :mod:`async_rl.rollout.vllm_stepped`): checks that a model and its KV cache fit vLLM here, the
per-device engine arguments (:func:`engine_kwargs`), new weights through ``/dev/shm`` (:func:`write_weights_file`,
read in vLLM's worker by :class:`WorkerExtension`), sampling settings, and a request's state and finished output.

Details: docs/rollout.md (10. vLLM).
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from async_rl.rollout.base import GenerationOutput, GenerationRequest, SamplingParams
from async_rl.rollout.wire import ENGINE_ERROR, first_stop_string
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


class RequestState:
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


def finished_output(state: "RequestState", tokenizer) -> GenerationOutput:
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


__all__ = ["CPU_MIN_HEAD_DIM", "KV_ON_UPDATE", "RequestState", "VLLM_FINISH_REASONS", "WorkerExtension", "cache_salt",
           "check_kv_cache_fits", "check_model_for_vllm", "engine_kwargs", "finish_from_vllm", "finished_output",
           "kv_cache_bytes_needed", "require_vllm", "startup_error_line", "vllm_available", "vllm_sampling_params",
           "write_weights_file"]
