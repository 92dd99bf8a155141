"""What travels between the :class:`~async_rl.rollout.pool.ReplicaPool` and a replica's server, whatever the engine:
sampling settings as a server dict (vLLM's names), replies as :class:`VersionedTokenOutput` (every token's version,
which per-token off-policy correction needs, spec §1), and their conversion back to a ``GenerationOutput``.

Details: docs/rollout.md (7, "Registry", "In-flight weight update").
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Optional

import torch
from verl.workers.rollout.replica import TokenOutput

from async_rl.rollout.base import GenerationOutput, GenerationRequest, SamplingParams

# engines served by our own server classes (servers/hf.py, servers/vllm.py): pause keeps requests, per-token versions
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


async def receive_all_weights(engine: Any, version: int) -> list[tuple[str, torch.Tensor]]:
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


__all__ = ["ENGINE_ERROR", "OWN_SERVER_ENGINES", "VersionedTokenOutput", "empty_output", "first_stop_string",
           "receive_all_weights", "sampling_from_server_dict", "sampling_to_server_dict", "token_output_to_generation",
           "versioned_reply"]
