"""vLLM stepped by its caller: the in-process rollout engine's interface on vLLM's ``LLMEngine``.

:class:`VLLMSteppedEngine` has the methods of :class:`~async_rl.rollout.hf_engine.HFRolloutEngine` that the rollout
contract (:class:`~async_rl.rollout.base.RolloutService`) and ``rollout.mode=hybrid`` call (``add_requests``,
``step``, ``abort``, ``update_weights``, ``export_inflight``/``import_inflight``, ``release_cache``), so a train rank
drives it exactly as it drives the hf engine: ``rollout.mode=hybrid rollout.engine=vllm`` (docs/rollout.md §8).

Where it runs. vLLM's engine core and model worker run in a child process of the caller (vLLM's multiprocess
engine client), on the caller's node and device. The child has its own ``torch.distributed`` world of one, so the
train rank's process group is never touched; new weights reach it through this node's shared memory
(:func:`~async_rl.rollout.vllm_setup.write_weights_file`), never through Ray or another node.

Semantics, as the hf engine's and the standalone vLLM server's ("recompute" mode):

* every token keeps the version and the processed log-prob that sampled it (spec §1);
* :meth:`update_weights` between steps: requests still generating are aborted in vLLM and resubmitted with their
  kept prefix (prompt + tokens so far) under the new weights, with a new prefix-cache salt, so no token is
  regenerated and no new request reuses KV computed under older weights. Tokens vLLM computed ahead of the last
  :meth:`step` but never returned are dropped and sampled again under the new weights: only returned tokens count;
* :meth:`release_cache` (a hybrid replica's sleep, before its train rank trains): the same abort-and-keep, so the
  engine computes nothing while the rank trains; on CUDA/ROCm/XPU vLLM then also sleeps (level 1: KV cache freed,
  weights offloaded to host memory) and wakes at the next step or update. vLLM has no sleep mode on CPU
  (``Platform.is_sleep_mode_available``): there the KV pool stays allocated and only the compute stops.

Drive it from one thread, between calls (no call runs concurrently with another).
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any, Optional

import torch

from async_rl.rollout.base import GenerationOutput, GenerationRequest, SamplingParams
from async_rl.rollout.vllm_setup import (RequestState, cache_salt, check_kv_cache_fits, check_model_for_vllm,
                                         engine_kwargs, finish_from_vllm, finished_output, require_vllm,
                                         startup_error_line, vllm_sampling_params, write_weights_file)
from async_rl.rollout.wire import ENGINE_ERROR


class VLLMSteppedEngine:
    """vLLM's ``LLMEngine`` behind the in-process engine interface (module docstring).

    Args:
        model_path: local Hugging Face checkpoint directory (the weights of ``initial_version``).
        device: "cpu" or "cuda" (vLLM picks its platform from the installed build).
        initial_version: policy version of the weights in ``model_path``.
        engine_options: extra :func:`~async_rl.rollout.vllm_setup.engine_kwargs` keywords (dtype, max_model_len,
            kv_cache_memory_bytes, gpu_memory_utilization, max_num_seqs, seed).
    """

    def __init__(self, model_path: str, device: str = "cpu", initial_version: int = 0,
                 engine_options: Optional[Mapping[str, Any]] = None) -> None:
        require_vllm()
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.llm_engine import LLMEngine

        if device not in ("cpu", "cuda"):
            raise ValueError(f"VLLMSteppedEngine device={device!r}; valid choices: cpu, cuda")
        options = {k: v for k, v in dict(engine_options or {}).items() if v is not None}
        check_model_for_vllm(str(model_path), device)
        check_kv_cache_fits(str(model_path), device, options)
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        kwargs = engine_kwargs(str(model_path), device, **options)
        self.sleep_available = device != "cpu" and current_platform.is_sleep_mode_available()
        if self.sleep_available:
            kwargs["enable_sleep_mode"] = True
        try:
            # the engine core in a child process: its own torch.distributed world, not the train rank's
            self.llm = LLMEngine.from_engine_args(EngineArgs(**kwargs), enable_multiprocessing=True)
        except Exception as error:
            raise RuntimeError(startup_error_line(error)) from None
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.vocab_size = len(self.tokenizer)
        self.max_model_len = int(self.llm.model_config.max_model_len)
        self.device = torch.device(device)
        self._version = int(initial_version)
        self._requests: dict[Hashable, RequestState] = {}  # every unfinished request, in arrival order
        self._pending: list[Hashable] = []  # unfinished and not in vLLM: new, or kept across an update / release
        self._in_vllm: dict[str, Hashable] = {}  # vLLM's external id of a running submission -> our request id
        self._read: dict[str, int] = {}  # tokens of that submission already recorded
        self._submissions: dict[Hashable, int] = {}  # submissions so far per request (a resubmission's seed offset)
        self._next_id = 0
        self._weights_epoch = 0  # weight loads so far: the prefix-cache salt of new submissions
        self.asleep = False
        self.counters = {"resubmitted": 0, "engine_errors": 0, "weight_updates": 0, "sleeps": 0}
        self.last_refusal: Optional[str] = None  # why vLLM last refused a request (it failed as an engine fault)

    # ------------------------------------------------------------------ state
    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ requests
    def _validate(self, requests: Sequence[GenerationRequest]) -> None:
        seen: set = set()
        for request in requests:
            if request.request_id in self._requests or request.request_id in seen:
                raise ValueError(f"request_id {request.request_id!r} is already unfinished in this engine")
            seen.add(request.request_id)
            if not request.prompt_ids:
                raise ValueError(f"request {request.request_id!r} has an empty prompt")
            if len(request.prompt_ids) >= self.max_model_len:
                raise ValueError(f"request {request.request_id!r}: its prompt has {len(request.prompt_ids)} tokens but "
                                 f"vLLM's max_model_len is {self.max_model_len} (rollout.vllm_max_model_len); shorten "
                                 f"the prompt or raise the limit")
            if any(not 0 <= int(t) < self.vocab_size for t in request.prompt_ids):
                raise ValueError(f"request {request.request_id!r} has token ids outside the vocabulary "
                                 f"(0..{self.vocab_size - 1})")
            if sum(1 for t in set(request.sampling.banned_token_ids) if 0 <= t < self.vocab_size) >= self.vocab_size:
                raise ValueError(f"request {request.request_id!r} bans every token id: nothing could be sampled")

    def add_requests(self, requests: Sequence[GenerationRequest]) -> None:
        """Queue ``requests`` (all or none: a bad one raises ``ValueError`` naming it); they reach vLLM at the next
        :meth:`step`."""
        requests = list(requests)
        self._validate(requests)
        for request in requests:
            self._requests[request.request_id] = RequestState(request)
            self._submissions[request.request_id] = 0
            self._pending.append(request.request_id)

    def _submit_pending(self) -> list[GenerationOutput]:
        """Send every pending request to vLLM with its kept prefix; one with nothing left to sample finishes here."""
        finished: list[GenerationOutput] = []
        pending, self._pending = self._pending, []
        while pending:
            request_id = pending.pop(0)
            state = self._requests[request_id]
            context = list(state.request.prompt_ids) + state.token_ids
            remaining = state.request.sampling.max_new_tokens - len(state.token_ids)
            if remaining <= 0 or len(context) >= self.max_model_len:
                state.finish = "length"
                finished.append(self._finish(request_id))
                continue
            submission = self._submissions[request_id]
            if submission:
                self.counters["resubmitted"] += 1
            self._submissions[request_id] = submission + 1
            external_id = f"async_rl-{self._next_id}"
            self._next_id += 1
            try:
                params = vllm_sampling_params(state.request.sampling, remaining, submission, self.vocab_size)
                self.llm.add_request(external_id, {"prompt_token_ids": context,
                                                   "cache_salt": cache_salt(self._weights_epoch)}, params)
            except ValueError as error:  # vLLM refused this request alone: it fails as an engine fault, never scored
                state.finish, state.stop_detail = "aborted", ENGINE_ERROR
                self.counters["engine_errors"] += 1
                self.last_refusal = f"{type(error).__name__}: {error}"
                finished.append(self._finish(request_id))
                continue
            except BaseException:
                self._pending = [request_id, *pending, *self._pending]  # nothing unsent is lost
                raise
            self._in_vllm[external_id], self._read[external_id] = request_id, 0
        return finished

    def _take_back(self) -> None:
        """Abort every running submission in vLLM; its request keeps the tokens recorded so far and is resubmitted at
        the next step (tokens vLLM computed but this engine never returned are dropped)."""
        if not self._in_vllm:
            return
        running = list(self._in_vllm)
        self.llm.abort_request(running, internal=False)
        for external_id in running:
            self._pending.append(self._in_vllm.pop(external_id))
            self._read.pop(external_id, None)

    def _finish(self, request_id: Hashable) -> GenerationOutput:
        state = self._requests.pop(request_id)
        self._submissions.pop(request_id, None)
        return finished_output(state, self.tokenizer)

    def _record(self, output) -> list[GenerationOutput]:
        """Record one of vLLM's cumulative outputs; the request's output once it finished."""
        request_id = self._in_vllm.get(output.request_id)
        if request_id is None:  # a submission aborted after vLLM computed it
            return []
        state, piece = self._requests[request_id], output.outputs[0]
        tokens, logprobs = list(piece.token_ids), piece.logprobs or []
        read = self._read[output.request_id]
        if len(tokens) > read:
            if len(logprobs) < len(tokens):
                raise RuntimeError(f"vLLM returned {len(tokens)} tokens but {len(logprobs)} log-probs")
            state.token_ids += tokens[read:]
            state.logprobs += [float(logprobs[i][tokens[i]].logprob) for i in range(read, len(tokens))]
            state.versions += [self._version] * (len(tokens) - read)
            self._read[output.request_id] = len(tokens)
        if piece.finish_reason is None:
            return []
        del self._in_vllm[output.request_id], self._read[output.request_id]
        state.finish, fault = finish_from_vllm(piece.finish_reason)
        state.stop_detail = fault if fault is not None else piece.stop_reason
        if fault is not None:
            self.counters["engine_errors"] += 1
        return [self._finish(request_id)]

    def step(self, max_tokens: Optional[int] = None) -> list[GenerationOutput]:
        """Run up to ``max_tokens`` engine iterations (about one token per running request each; None: until every
        request finished); the requests that finished, in the order they did."""
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}")
        self._wake()
        finished = self._submit_pending()
        iterations = 0
        while self._in_vllm and (max_tokens is None or iterations < max_tokens):
            self._wait_for_output()
            for output in self.llm.step():
                finished += self._record(output)
            iterations += 1
        return finished

    def _wait_for_output(self) -> None:
        """Block until vLLM's engine process has sent an output, or raise if that process died: vLLM's own
        ``get_output`` would wait for ever then (its reader thread stops without a word when the process is gone)."""
        core = self.llm.engine_core
        outputs, resources = getattr(core, "outputs_queue", None), getattr(core, "resources", None)
        if outputs is None or resources is None:  # an in-process engine core: step() computes the output itself
            return
        with outputs.not_empty:
            while not len(outputs.queue):
                if resources.engine_dead:
                    raise RuntimeError("vLLM's engine process died (killed, or out of memory); this rollout engine "
                                       "cannot go on")
                outputs.not_empty.wait(0.05)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        """Run ``requests`` to completion (with any already unfinished); their outputs in request order."""
        requests = list(requests)
        self.add_requests(requests)
        wanted = {request.request_id for request in requests}
        done: dict[Hashable, GenerationOutput] = {}
        while wanted - set(done):
            for output in self.step(None):
                done[output.request_id] = output
        return [done[request.request_id] for request in requests]

    def abort(self, request_ids: Optional[Iterable[Hashable]] = None) -> list[GenerationOutput]:
        """End these requests (None: all unfinished) as "aborted" with their tokens so far; vLLM stops them now."""
        wanted = set(self._requests) if request_ids is None else set(request_ids) & set(self._requests)
        running = [external for external, request_id in self._in_vllm.items() if request_id in wanted]
        if running:
            self.llm.abort_request(running, internal=False)
        for external_id in running:
            del self._in_vllm[external_id], self._read[external_id]
        self._pending = [request_id for request_id in self._pending if request_id not in wanted]
        outputs = []
        for request_id in [r for r in self._requests if r in wanted]:
            self._requests[request_id].finish = "aborted"
            outputs.append(self._finish(request_id))
        return outputs

    # ------------------------------------------------------------------ weights and memory
    def update_weights(self, state_dict: Any, version: int) -> None:
        """Load ``state_dict`` (HF names -> tensors, full or partial; empty: the version only) as ``version``; running
        requests go on from their kept prefixes under it (module docstring)."""
        self._wake()
        self._take_back()
        weights = dict(state_dict.items()) if isinstance(state_dict, Mapping) else dict(state_dict)
        if weights:
            path = write_weights_file(weights, f"{os.getpid()}_{id(self) & 0xffff:x}_{version}")
            try:
                self.llm.collective_rpc("async_rl_load_weights", args=(path,))
            finally:
                os.unlink(path)
            self._weights_epoch += 1  # new submissions never reuse KV of the old weights
            self.llm.reset_prefix_cache()  # nothing runs now: frees the cache's blocks
        self._version = int(version)
        self.counters["weight_updates"] += 1

    def release_cache(self) -> None:
        """Stop computing until the next :meth:`step` or :meth:`update_weights`; requests keep their tokens. On a
        platform with vLLM's sleep mode it also sleeps (KV cache freed, weights offloaded)."""
        self._take_back()
        if self.sleep_available and not self.asleep:
            self.asleep = True  # first: a sleep that fails half-way must still be woken (vLLM paused its scheduler)
            self.llm.sleep(level=1)
            self.counters["sleeps"] += 1

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    # ------------------------------------------------------------------ checkpoints
    def export_inflight(self) -> list[dict]:
        """Unfinished requests with the tokens / log-probs / versions recorded so far (as the hf engine's)."""
        return [{"request_id": state.request.request_id, "prompt_ids": list(state.request.prompt_ids),
                 "sampling": dict(vars(state.request.sampling)), "token_ids": list(state.token_ids),
                 "logprobs": list(state.logprobs), "versions": list(state.versions)}
                for state in self._requests.values()]

    def import_inflight(self, states: list[dict]) -> None:
        """Resubmit :meth:`export_inflight`'s requests (or the hf engine's), each from its prefix."""
        if self._requests:
            raise RuntimeError("import_inflight() needs an idle engine (no unfinished request)")
        requests = [GenerationRequest(s["request_id"], list(s["prompt_ids"]), SamplingParams(**s["sampling"]))
                    for s in states]
        self.add_requests(requests)
        for saved in states:
            state = self._requests[saved["request_id"]]
            state.token_ids, state.logprobs = list(saved["token_ids"]), list(saved["logprobs"])
            state.versions = list(saved["versions"])
            self._submissions[saved["request_id"]] = 1  # a resubmission: its seed moves on

    def shutdown(self) -> None:
        """Stop vLLM's engine process."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.engine_core.shutdown()


__all__ = ["VLLMSteppedEngine"]
