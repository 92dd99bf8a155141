"""Transformers rollout engine: batched, KV-cached sampling with in-flight weight updates.

:class:`HFRolloutEngine` runs on CPU or CUDA with any ``AutoModelForCausalLM`` that takes the cache arguments
it needs (the tiny Qwen2 of :mod:`async_rl.models.tiny`, real Qwen2.5 checkpoints). Entry points:
``generate(requests)``, or chunked ``start`` / ``step(n)`` / ``add_requests`` (continuous batching);
``update_weights`` / ``pause`` / ``resume`` / ``abort`` may come from another thread and are applied at the next
token boundary. On an update the KV cache is dropped and unfinished sequences are re-prefilled from
``prompt + generated prefix`` under the new weights; earlier tokens keep their log-prob and version.

Details: docs/rollout.md (3. HFRolloutEngine; "In-flight weight updates").
"""

from __future__ import annotations

import os
import threading
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from async_rl.rollout.base import (
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    RolloutEngine,
    SamplingParams,
    WeightsLike,
)

# Draw per-request seeds below this bound when SamplingParams.seed is None.
_SEED_BOUND = 2**62
_MASK64 = 2**64 - 1
# SplitMix64 constants (Steele, Lea & Flood 2014) as signed int64, the dtype torch computes in.
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
# A character is at most 4 UTF-8 bytes, i.e. at most 4 byte-level tokens; decoding this
# many trailing tokens per stop-string character is enough to see any stop string that the
# last sampled token completed (plus slack for a multi-byte char cut at the window start).
_TOKENS_PER_STOP_CHAR = 4
_STOP_WINDOW_SLACK = 4


def _as_int64(value: int) -> int:
    """The signed 64-bit integer with the same bits as ``value`` mod 2**64."""
    value &= _MASK64
    return value - 2**64 if value >= 2**63 else value


def _splitmix64_mix(z: int) -> int:
    """SplitMix64's output function on a Python int (64-bit wrap-around), for seeding a stream."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MIX_MULTIPLIERS[0]) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX_MULTIPLIERS[1]) & _MASK64
    return z ^ (z >> 31)


def stream_key(seed: int) -> int:
    """The per-request stream key (signed int64) for a sampling seed: the seed passed through the mixer,
    so that nearby seeds (0, 1, 2, ...) start far apart in the SplitMix64 sequence."""
    return _as_int64(_splitmix64_mix(int(seed)))


def stream_uniforms(keys: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Uniforms in [0, 1) (float64), one per row: draw number ``draws[r]`` of the stream ``keys[r]``.

    A counter-based generator: draw ``n`` of a stream is SplitMix64's ``n + 1``-th output from state
    ``key``, i.e. ``mix(key + (n + 1) * gamma)`` -- a pure function of ``(key, n)``. So all live requests
    are sampled with one batched computation, a request's draws never depend on the other rows, and a
    checkpoint needs nothing but the number of tokens a request already has. ``keys``/``draws``: (B,) int64.
    Same numbers as the scalar reference :func:`_stream_uniform_reference` (tested).
    """

    def logical_shift(z: torch.Tensor, bits: int) -> torch.Tensor:
        # torch's >> on int64 is arithmetic (copies the sign bit); mask the copies away
        return (z >> bits) & ((1 << (64 - bits)) - 1)

    # int64 multiplication wraps around mod 2**64, which is exactly SplitMix64's arithmetic
    z = keys + (draws + 1) * _as_int64(_GOLDEN_GAMMA)
    z = (z ^ logical_shift(z, 30)) * _as_int64(_MIX_MULTIPLIERS[0])
    z = (z ^ logical_shift(z, 27)) * _as_int64(_MIX_MULTIPLIERS[1])
    z = z ^ logical_shift(z, 31)
    return logical_shift(z, 11).double() * 2.0**-53  # top 53 bits: exactly representable


def _stream_uniform_reference(key: int, draw: int) -> float:
    """Plain-Python SplitMix64 draw, the reference :func:`stream_uniforms` is tested against."""
    state = (key + (draw + 1) * _GOLDEN_GAMMA) & _MASK64
    return (_splitmix64_mix(state) >> 11) * 2.0**-53


@dataclass
class _SequenceState:
    """Bookkeeping for one request while it is being generated."""

    request: GenerationRequest
    stream_key: int  # its random stream (see stream_uniforms); draw n samples token n
    stop_token_ids: frozenset[int]
    stop_window_tokens: int  # trailing tokens decoded when checking stop strings
    token_limit: int  # max_new_tokens, capped so the context fits max_position_embeddings
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    output: GenerationOutput | None = None  # built once, when the sequence finishes

    @property
    def context_ids(self) -> list[int]:
        """prompt + generated tokens: what a re-prefill feeds to the model."""
        return self.request.prompt_ids + self.token_ids


@dataclass
class _Batch:
    """Tensor state of the unfinished sequences; row ``r`` belongs to ``sequences[active[r]]``.

    Shapes (B = number of unfinished sequences, L = padded context length, V = vocab):
        attention_mask:  [B, L] long, 0 on left padding.
        next_positions:  [B] long, position id of the next token fed to the model
                         (= number of real tokens already in the cache).
        last_token_ids:  [B, 1] long, tokens sampled last step and not yet in the cache.
        temperatures:    [B, 1] float32, the log-prob temperature (1 for greedy rows).
        greedy:          [B] bool.
        top_p:           [B] float32.
        banned_mask:     [B, V] bool (True = never sample) or None when nothing is banned.
        stream_keys:     [B] int64, each row's random stream; draws: [B] int64, tokens it sampled so far.
    ``cache`` is None before the first forward pass and after a weight update; the next
    step then re-prefills every unfinished sequence from its full context.
    """

    sequences: list[_SequenceState]
    active: list[int]
    temperatures: torch.Tensor
    greedy: torch.Tensor
    top_p: torch.Tensor
    banned_mask: torch.Tensor | None
    stream_keys: torch.Tensor
    draws: torch.Tensor
    num_decode_steps: int = 0  # tokens sampled so far per (still running) sequence
    cache: object | None = None
    attention_mask: torch.Tensor | None = None
    next_positions: torch.Tensor | None = None
    last_token_ids: torch.Tensor | None = None

    def select_rows(self, rows: list[int]) -> None:
        """Keep only tensor rows ``rows`` (finished sequences leave the batch)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.temperatures.device)
        self.active = [self.active[r] for r in rows]
        self.temperatures = self.temperatures[index]
        self.greedy = self.greedy[index]
        self.top_p = self.top_p[index]
        self.stream_keys = self.stream_keys[index]
        self.draws = self.draws[index]
        if self.banned_mask is not None:
            self.banned_mask = self.banned_mask[index]
        if self.cache is not None:
            self.cache.batch_select_indices(index)
            self.attention_mask = self.attention_mask[index]
            self.next_positions = self.next_positions[index]
            self.last_token_ids = self.last_token_ids[index]


class HFRolloutEngine(RolloutEngine):
    """Rollout engine on top of a transformers causal LM (CPU or CUDA).

    Args:
        model: a local checkpoint directory, a ``(model, tokenizer)`` tuple, or a
            ``PreTrainedModel`` (then ``tokenizer`` is required).
        tokenizer: the tokenizer when ``model`` is a model object.
        device: where the model runs; the model is moved there.
        dtype: only used when loading from a path (``None`` = checkpoint dtype).
        initial_version: :attr:`policy_version` before the first :meth:`update_weights`.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        initial_version: int = 0,
    ) -> None:
        if isinstance(model, (str, os.PathLike)):
            from async_rl.models.loading import load_causal_lm, load_tokenizer

            model_path = model
            model = load_causal_lm(model_path, dtype=dtype, device=device)
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_path)
        elif isinstance(model, tuple):
            model, tokenizer = model
        if tokenizer is None:
            raise ValueError(
                "HFRolloutEngine needs a tokenizer: pass a model directory, a (model, tokenizer) "
                "tuple, or tokenizer=... together with a model object."
            )
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None)
        self.pad_token_id = next(
            (t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0
        )
        self.eos_token_ids = self._collect_eos_token_ids()

        self._version = int(initial_version)
        self._batch: _Batch | None = None
        # One condition variable guards all cross-thread state below.
        self._cond = threading.Condition()
        self._stepping_thread: int | None = None  # ident of the thread inside step()
        self._paused = False
        self._paused_by_thread: int | None = None
        self._parked = False  # decode loop is waiting at a token boundary because paused
        self._pending_weights: tuple[list[tuple[str, torch.Tensor]], int, int] | None = None
        self._update_tickets_issued = 0
        self._update_tickets_done = 0
        self._update_errors: dict[int, BaseException] = {}
        self._pending_abort: set[Hashable] | None = None
        self._abort_all = False

    # ------------------------------------------------------------------ public API

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def has_unfinished(self) -> bool:
        """True between :meth:`start` and the step that finishes the last sequence."""
        return self._batch is not None

    @property
    def num_unfinished(self) -> int:
        batch = self._batch
        return 0 if batch is None else len(batch.active)

    @property
    def num_decode_steps(self) -> int:
        """Decode iterations done for the current batch (0 when idle); for progress/monitoring."""
        batch = self._batch
        return 0 if batch is None else batch.num_decode_steps

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        """Run ``requests`` to completion; outputs in request order.

        Safe to combine with :meth:`update_weights`, :meth:`pause`, :meth:`resume` and
        :meth:`abort` called from other threads while it runs.
        """
        self._check_not_paused_by_this_thread()  # before start(): don't leave a batch behind
        self.start(requests)
        sequences = self._batch.sequences
        # Outputs are rebuilt from the sequence states rather than collected from step():
        # an abort() from another thread may finish sequences outside any step() call.
        self._step(None, require_batch=False)
        return [self._to_output(seq) for seq in sequences]

    def start(self, requests: Sequence[GenerationRequest]) -> None:
        """Begin generating ``requests`` (no compute yet); drive with :meth:`step`."""
        requests = list(requests)
        with self._cond:
            if self._batch is not None:
                raise RuntimeError(
                    "HFRolloutEngine already has a batch in flight: call step() until it returns "
                    "the remaining outputs (or abort()) before starting new requests."
                )
            self._validate_requests(requests)
            sequences = [self._new_sequence_state(request) for request in requests]
            self._batch = self._new_batch(sequences)
            self._pending_abort, self._abort_all = None, False

    def export_inflight(self) -> list[dict]:
        """Unfinished sequences as plain data, in batch order, for a checkpoint (call between chunks).

        Each entry: the request, the tokens / log-probs / versions generated so far, and the key of its
        random stream (its position is the number of tokens), so :meth:`import_inflight` continues every
        sequence exactly where it stopped.
        """
        with self._cond:
            if self._stepping_thread is not None:
                raise RuntimeError("export_inflight() must be called between step() calls")
            if self._batch is None:
                return []
            out = []
            for i in self._batch.active:
                seq = self._batch.sequences[i]
                out.append({
                    "request_id": seq.request.request_id,
                    "prompt_ids": list(seq.request.prompt_ids),
                    "sampling": dict(vars(seq.request.sampling)),
                    "token_ids": list(seq.token_ids),
                    "logprobs": list(seq.logprobs),
                    "versions": list(seq.versions),
                    "stream_key": seq.stream_key,
                })
            return out

    def import_inflight(self, states: list[dict]) -> None:
        """Recreate sequences saved by :meth:`export_inflight`; they are re-prefilled on the next step."""
        with self._cond:
            if self._batch is not None:
                raise RuntimeError("import_inflight() needs an idle engine (no batch in flight)")
            if not states:
                return
            sequences = []
            for state in states:
                request = GenerationRequest(state["request_id"], list(state["prompt_ids"]),
                                            SamplingParams(**state["sampling"]))
                seq = self._new_sequence_state(request)
                if "stream_key" in state:  # absent in checkpoints of the generator-per-request engine
                    seq.stream_key = int(state["stream_key"])
                seq.token_ids = list(state["token_ids"])
                seq.logprobs = list(state["logprobs"])
                seq.versions = list(state["versions"])
                sequences.append(seq)
            self._batch = self._new_batch(sequences)
            self._pending_abort, self._abort_all = None, False

    def add_requests(self, requests: Sequence[GenerationRequest]) -> None:
        """Join ``requests`` to the batch in flight (continuous batching); like ``start`` if idle.

        Call between chunks from the thread that drives ``step``. The newcomers' contexts
        (minus their last token) are prefilled now and their keys/values are merged into
        the running KV cache, so rows already decoding are not recomputed; from the next
        ``step`` on every row advances one token per iteration.
        """
        requests = list(requests)
        with self._cond:
            if self._stepping_thread is not None:
                raise RuntimeError(
                    "add_requests() must be called between step() calls by the thread that drives "
                    "them, not while step()/generate() is running."
                )
            if self._batch is None:
                self._validate_requests(requests)
                self._batch = self._new_batch([self._new_sequence_state(r) for r in requests])
                self._pending_abort, self._abort_all = None, False
                return
            in_flight = {self._batch.sequences[i].request.request_id for i in self._batch.active}
            self._validate_requests(requests, in_flight_ids=in_flight)
            self._join_locked([self._new_sequence_state(r) for r in requests])

    def step(self, max_tokens: int | None = None) -> list[GenerationOutput]:
        """Sample up to ``max_tokens`` more tokens for every unfinished sequence.

        ``None`` runs until all sequences finish. Returns the outputs of sequences that
        finished (or were aborted) during this call, in the order they finished.
        """
        return self._step(max_tokens, require_batch=True)

    def _step(self, max_tokens: int | None, require_batch: bool) -> list[GenerationOutput]:
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}")
        self._enter_step(require_batch)
        finished: list[GenerationOutput] = []
        try:
            tokens_done = 0
            while self._batch is not None and (max_tokens is None or tokens_done < max_tokens):
                finished += self._token_boundary()
                if self._batch is None:
                    break
                finished += self._decode_one_token()
                tokens_done += 1
        finally:
            self._exit_step()
        return finished

    def update_weights(self, state_dict: WeightsLike, version: int, *, blocking: bool = True) -> None:
        """Load new weights and set :attr:`policy_version` to ``version``.

        ``state_dict`` maps parameter names (as in ``model.state_dict()``) to tensors of the
        same shape (any dtype/device; values are copied). It may be partial; unknown names
        or shape mismatches raise ``ValueError`` before anything is copied.

        Between chunks (no ``step`` running) the update is applied immediately. While
        another thread is inside ``step``/``generate`` it is queued and applied by the
        decode loop at the next token boundary (a newer queued update replaces an older
        one); with ``blocking=True`` this call returns only once it has been applied.
        Either way unfinished sequences are re-prefilled under the new weights.
        """
        weights = list(state_dict.items()) if isinstance(state_dict, Mapping) else list(state_dict)
        with self._cond:
            if self._stepping_thread is None:
                self._load_weights_locked(weights, int(version))
                return
            if self._stepping_thread == threading.get_ident():
                raise RuntimeError("update_weights() was called from inside step(); call it between steps.")
            self._update_tickets_issued += 1
            ticket = self._update_tickets_issued
            self._pending_weights = (weights, int(version), ticket)
            self._cond.notify_all()  # wake a decode loop parked by pause()
            if not blocking:
                return
            while self._update_tickets_done < ticket:
                self._cond.wait()
            error = self._update_errors.pop(ticket, None)
        if error is not None:
            raise error

    def release_cache(self) -> None:
        """Free the KV cache of the batch in flight; every unfinished sequence keeps its tokens, log-probs and
        versions and is re-prefilled at the next step (``rollout.mode=hybrid`` sleeps the engine this way
        before a training step reuses the device). Call between steps."""
        with self._cond:
            if self._stepping_thread is not None:
                raise RuntimeError("release_cache() must be called between step() calls")
            self._drop_cache_locked()

    def pause(self, wait: bool = True) -> None:
        """Hold the decode loop at the next token boundary until :meth:`resume`.

        With ``wait=True`` (from another thread) returns once the loop is parked or no
        step is running. Updates/aborts sent while paused are applied while parked.
        Calling ``step``/``generate`` from the thread that paused raises instead of
        deadlocking.
        """
        with self._cond:
            self._paused = True
            self._paused_by_thread = threading.get_ident()
            if wait and self._stepping_thread != threading.get_ident():
                while self._stepping_thread is not None and not self._parked:
                    self._cond.wait()

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._paused_by_thread = None
            self._cond.notify_all()

    @property
    def is_paused(self) -> bool:
        return self._paused

    def abort(self, request_ids: Iterable[Hashable] | None = None) -> list[GenerationOutput]:
        """Finish ``request_ids`` (all unfinished if None) with ``finish_reason="aborted"``.

        Between chunks the aborted outputs are returned here. While another thread is in
        ``step``/``generate`` the abort is applied at the next token boundary and the
        outputs are returned by that ``step``/``generate`` instead (this returns ``[]``).
        """
        with self._cond:
            if self._batch is None:
                return []
            if self._stepping_thread is None:
                return self._abort_locked(None if request_ids is None else set(request_ids))
            if request_ids is None:
                self._abort_all = True
            else:
                self._pending_abort = (self._pending_abort or set()) | set(request_ids)
            self._cond.notify_all()
            return []

    # ------------------------------------------------------------ setup / validation

    def _collect_eos_token_ids(self) -> frozenset[int]:
        """eos ids from the tokenizer and the generation config (Qwen2.5-Instruct lists two)."""
        eos: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        generation_config = getattr(self.model, "generation_config", None)
        config_eos = getattr(generation_config, "eos_token_id", None)
        if isinstance(config_eos, int):
            eos.add(config_eos)
        elif config_eos is not None:
            eos.update(int(t) for t in config_eos)
        return frozenset(eos)

    def _validate_requests(
        self, requests: list[GenerationRequest], in_flight_ids: set[Hashable] = frozenset()
    ) -> None:
        if not requests:
            raise ValueError("start()/generate()/add_requests() needs at least one GenerationRequest")
        seen: set[Hashable] = set(in_flight_ids)
        for request in requests:
            rid = request.request_id
            if rid in seen:
                raise ValueError(f"duplicate request_id {rid!r}: request ids must be unique within a batch")
            seen.add(rid)
            if not request.prompt_ids:
                raise ValueError(f"request {rid!r} has an empty prompt_ids; give at least one token")
            sampling = request.sampling
            for what, ids in (
                ("prompt_ids", request.prompt_ids),
                ("banned_token_ids", sampling.banned_token_ids),
                ("stop_token_ids", sampling.stop_token_ids),
            ):
                bad = [t for t in ids if not 0 <= int(t) < self.vocab_size]
                if bad:
                    raise ValueError(
                        f"request {rid!r}: {what} contains ids outside [0, {self.vocab_size}): {bad[:5]}"
                    )
            if len(set(sampling.banned_token_ids)) >= self.vocab_size:
                raise ValueError(f"request {rid!r} bans every token id; nothing could be sampled")
            if self.max_positions is not None and len(request.prompt_ids) >= self.max_positions:
                raise ValueError(
                    f"request {rid!r}: the prompt has {len(request.prompt_ids)} tokens, which leaves no "
                    f"room in the model's max_position_embeddings={self.max_positions}; shorten the "
                    f"prompt (e.g. truncate old turns)."
                )

    def _new_sequence_state(self, request: GenerationRequest) -> _SequenceState:
        sampling = request.sampling
        seed = sampling.seed
        if seed is None:
            # Drawn from torch's global RNG so torch.manual_seed() makes unseeded runs repeatable.
            seed = int(torch.randint(0, _SEED_BOUND, (), dtype=torch.long).item())
        stop_ids = set(int(t) for t in sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids |= self.eos_token_ids
        longest_stop = max((len(s) for s in sampling.stop_strings), default=0)
        token_limit = sampling.max_new_tokens
        if self.max_positions is not None:
            # Like vLLM: a context that reaches the model's length ends with "length".
            token_limit = min(token_limit, self.max_positions - len(request.prompt_ids))
        return _SequenceState(
            request=GenerationRequest(request.request_id, [int(t) for t in request.prompt_ids], sampling),
            stream_key=stream_key(seed),
            stop_token_ids=frozenset(stop_ids),
            stop_window_tokens=_TOKENS_PER_STOP_CHAR * longest_stop + _STOP_WINDOW_SLACK,
            token_limit=token_limit,
        )

    def _new_batch(self, sequences: list[_SequenceState]) -> _Batch:
        samplings = [seq.request.sampling for seq in sequences]
        banned_mask = None
        if any(s.banned_token_ids for s in samplings):
            banned_mask = torch.zeros(len(sequences), self.vocab_size, dtype=torch.bool, device=self.device)
            for row, sampling in enumerate(samplings):
                if sampling.banned_token_ids:
                    ids = torch.tensor(sampling.banned_token_ids, dtype=torch.long, device=self.device)
                    banned_mask[row, ids] = True
        return _Batch(
            sequences=sequences,
            active=list(range(len(sequences))),
            temperatures=torch.tensor(
                [[s.logprob_temperature] for s in samplings], dtype=torch.float32, device=self.device
            ),
            greedy=torch.tensor([s.temperature == 0 for s in samplings], dtype=torch.bool, device=self.device),
            top_p=torch.tensor([s.top_p for s in samplings], dtype=torch.float32, device=self.device),
            banned_mask=banned_mask,
            stream_keys=torch.tensor([seq.stream_key for seq in sequences], dtype=torch.long, device=self.device),
            draws=torch.tensor([len(seq.token_ids) for seq in sequences], dtype=torch.long, device=self.device),
        )

    # --------------------------------------------------- cross-thread coordination

    def _check_not_paused_by_this_thread(self) -> None:
        with self._cond:
            if self._paused and self._paused_by_thread == threading.get_ident():
                # Stepping would wait for a resume() that this very thread can never send.
                raise RuntimeError("the engine was paused by this thread; call resume() before step()/generate()")

    def _enter_step(self, require_batch: bool) -> None:
        self._check_not_paused_by_this_thread()
        me = threading.get_ident()
        with self._cond:
            if self._stepping_thread is not None:
                raise RuntimeError("step()/generate() is already running in another thread")
            if self._batch is None and require_batch:
                raise RuntimeError("nothing to step: call start(requests) first (or use generate())")
            self._stepping_thread = me

    def _exit_step(self) -> None:
        with self._cond:
            self._stepping_thread = None
            self._parked = False
            # An update queued after the last token boundary must not be lost (its sender
            # may be blocked waiting for it).
            self._apply_pending_weights_locked()
            self._cond.notify_all()

    def _token_boundary(self) -> list[GenerationOutput]:
        """Apply queued updates/aborts; park here while paused. Runs in the decode thread."""
        finished: list[GenerationOutput] = []
        with self._cond:
            while True:
                self._apply_pending_weights_locked()
                if self._abort_all or self._pending_abort:
                    request_ids = None if self._abort_all else self._pending_abort
                    self._pending_abort, self._abort_all = None, False
                    finished += self._abort_locked(request_ids)
                if not self._paused:
                    break
                self._parked = True
                self._cond.notify_all()  # tell pause(wait=True) that we are parked
                self._cond.wait()
            self._parked = False
        return finished

    def _apply_pending_weights_locked(self) -> None:
        if self._pending_weights is None:
            return
        weights, version, ticket = self._pending_weights
        self._pending_weights = None
        try:
            self._load_weights_locked(weights, version)
        except Exception as error:  # reported to the update_weights() caller, loop goes on
            self._update_errors[ticket] = error
        self._update_tickets_done = ticket
        self._cond.notify_all()

    def _load_weights_locked(self, weights: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy ``weights`` into the model, set the version and drop the (stale) KV cache."""
        # keep_vars=True gives the live Parameters; tied weights appear under both names.
        targets = self.model.state_dict(keep_vars=True)
        unknown = [name for name, _ in weights if name not in targets]
        if unknown:
            raise ValueError(
                f"update_weights: {len(unknown)} names are not parameters of the rollout model, "
                f"e.g. {unknown[:3]}; send names as in model.state_dict() (strip wrapper prefixes "
                f"such as 'module.' or '_fsdp_wrapped_module.')."
            )
        mismatched = [
            (name, tuple(tensor.shape), tuple(targets[name].shape))
            for name, tensor in weights
            if tuple(tensor.shape) != tuple(targets[name].shape)
        ]
        if mismatched:
            raise ValueError(f"update_weights: shape mismatch (name, given, expected): {mismatched[:3]}")
        with torch.no_grad():
            for name, tensor in weights:
                targets[name].data.copy_(tensor)
        self._version = version
        self._drop_cache_locked()  # keys/values were computed by the old weights: re-prefill at the next token

    def _drop_cache_locked(self) -> None:
        if self._batch is not None:
            self._batch.cache = None
            self._batch.attention_mask = self._batch.next_positions = self._batch.last_token_ids = None

    # --------------------------------------------------------- batch membership / KV cache

    def _abort_locked(self, request_ids: set[Hashable] | None) -> list[GenerationOutput]:
        batch = self._batch
        if batch is None:
            return []
        aborted, keep_rows = [], []
        for row, seq_index in enumerate(batch.active):
            seq = batch.sequences[seq_index]
            if request_ids is None or seq.request.request_id in request_ids:
                seq.finish_reason = "aborted"
                aborted.append(self._to_output(seq))
            else:
                keep_rows.append(row)
        self._keep_rows(keep_rows)
        return aborted

    def _keep_rows(self, keep_rows: list[int]) -> None:
        batch = self._batch
        if not keep_rows:
            self._batch = None  # drops the KV cache too
        elif len(keep_rows) < len(batch.active):
            batch.select_rows(keep_rows)
            self._trim_leading_padding(batch)

    @staticmethod
    def _cache_is_mergeable(cache) -> bool:
        """True for a DynamicCache of plain (full-attention) layers, whose keys/values we can
        pad, slice and concatenate along the sequence axis; sliding-window layers keep
        extra bookkeeping, so for them joins fall back to a full re-prefill."""
        from transformers.cache_utils import DynamicLayer

        layers = getattr(cache, "layers", None)
        return bool(layers) and all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers)

    def _trim_leading_padding(self, batch: _Batch) -> None:
        """Drop cache columns that are padding for every remaining row (they only cost time)."""
        if batch.cache is None or not self._cache_is_mergeable(batch.cache):
            return
        first_used = int(batch.attention_mask.any(dim=0).long().argmax())  # first column in use
        if first_used == 0:
            return
        batch.attention_mask = batch.attention_mask[:, first_used:]
        for layer in batch.cache.layers:
            layer.keys = layer.keys[:, :, first_used:, :]
            layer.values = layer.values[:, :, first_used:, :]

    def _join_locked(self, newcomers: list[_SequenceState]) -> None:
        """Append ``newcomers`` as new rows of the batch in flight (see :meth:`add_requests`)."""
        batch = self._batch
        rows = self._new_batch(newcomers)
        first_index = len(batch.sequences)
        batch.sequences += newcomers
        batch.active += list(range(first_index, first_index + len(newcomers)))
        batch.temperatures = torch.cat([batch.temperatures, rows.temperatures])
        batch.greedy = torch.cat([batch.greedy, rows.greedy])
        batch.top_p = torch.cat([batch.top_p, rows.top_p])
        batch.stream_keys = torch.cat([batch.stream_keys, rows.stream_keys])
        batch.draws = torch.cat([batch.draws, rows.draws])
        if batch.banned_mask is not None or rows.banned_mask is not None:
            batch.banned_mask = torch.cat([self._banned_or_none(batch.banned_mask, len(batch.active) - len(newcomers)),
                                           self._banned_or_none(rows.banned_mask, len(newcomers))])
        if batch.cache is None:
            return  # the next step prefills every row anyway
        if not self._cache_is_mergeable(batch.cache):
            batch.cache = batch.attention_mask = batch.next_positions = batch.last_token_ids = None
            return
        self._prefill_and_merge(batch, newcomers)

    def _banned_or_none(self, mask: torch.Tensor | None, num_rows: int) -> torch.Tensor:
        if mask is not None:
            return mask
        return torch.zeros(num_rows, self.vocab_size, dtype=torch.bool, device=self.device)

    @torch.inference_mode()
    def _prefill_and_merge(self, batch: _Batch, newcomers: list[_SequenceState]) -> None:
        """Prefill newcomers' contexts without their last token and merge into ``batch.cache``.

        The last context token becomes the row's ``last_token_ids`` entry, so the next decode
        step feeds it together with the other rows' last sampled tokens. Caches are aligned
        on the right (left-padded with zero keys/values and mask 0) to a common width.
        """
        from transformers import DynamicCache

        prefixes = [seq.context_ids[:-1] for seq in newcomers]
        new_width = max(len(p) for p in prefixes)
        new_mask = torch.zeros((len(prefixes), new_width), dtype=torch.long)
        new_input_ids = torch.full((len(prefixes), new_width), self.pad_token_id, dtype=torch.long)
        for row, prefix in enumerate(prefixes):
            if prefix:
                new_input_ids[row, new_width - len(prefix):] = torch.tensor(prefix, dtype=torch.long)
                new_mask[row, new_width - len(prefix):] = 1
        new_mask, new_input_ids = new_mask.to(self.device), new_input_ids.to(self.device)
        new_cache = None
        if new_width > 0:
            new_cache = DynamicCache(config=self.model.config)
            self.model(
                input_ids=new_input_ids,
                attention_mask=new_mask,
                position_ids=(new_mask.cumsum(dim=-1) - 1).clamp(min=0),
                past_key_values=new_cache,
                use_cache=True,
                logits_to_keep=1,
            )

        old_width = batch.attention_mask.shape[1]
        width = max(old_width, new_width)

        def left_pad(tensor: torch.Tensor, dim: int, to: int) -> torch.Tensor:
            missing = to - tensor.shape[dim]
            if missing == 0:
                return tensor
            shape = list(tensor.shape)
            shape[dim] = missing
            return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)

        for layer_index, layer in enumerate(batch.cache.layers):
            for name in ("keys", "values"):
                old = getattr(layer, name)  # [B_old, kv_heads, old_width, head_dim]
                if new_cache is not None:
                    new = getattr(new_cache.layers[layer_index], name)
                else:
                    new = old.new_zeros((len(newcomers), old.shape[1], 0, old.shape[3]))
                setattr(layer, name, torch.cat([left_pad(old, 2, width), left_pad(new, 2, width)], dim=0))
        batch.attention_mask = torch.cat([left_pad(batch.attention_mask, 1, width), left_pad(new_mask, 1, width)])
        new_positions = torch.tensor([len(p) for p in prefixes], dtype=torch.long, device=self.device)
        batch.next_positions = torch.cat([batch.next_positions, new_positions])
        last_ids = torch.tensor([[seq.context_ids[-1]] for seq in newcomers], dtype=torch.long, device=self.device)
        batch.last_token_ids = torch.cat([batch.last_token_ids, last_ids])

    # ------------------------------------------------------------------- decoding

    @torch.inference_mode()
    def _forward_next_logits(self, batch: _Batch) -> torch.Tensor:
        """Logits for the next token of every unfinished sequence: [B, V] float32.

        Prefills from the full contexts when there is no cache (first step, or after a
        weight update); otherwise feeds only the tokens sampled last step.
        """
        if batch.cache is None:
            from transformers import DynamicCache

            contexts = [batch.sequences[i].context_ids for i in batch.active]
            lengths = torch.tensor([len(c) for c in contexts], dtype=torch.long)
            width = int(lengths.max())
            # Left padding: every row's next token lands in the same (last) column.
            input_ids = torch.full((len(contexts), width), self.pad_token_id, dtype=torch.long)
            attention_mask = torch.zeros((len(contexts), width), dtype=torch.long)
            for row, context in enumerate(contexts):
                input_ids[row, width - len(context):] = torch.tensor(context, dtype=torch.long)
                attention_mask[row, width - len(context):] = 1
            input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
            # Positions count real tokens only, so a padded row sees the same positions
            # (hence the same logits) as it would unpadded.
            position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
            cache = DynamicCache(config=self.model.config)
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            batch.cache = out.past_key_values
            batch.attention_mask = attention_mask
            batch.next_positions = lengths.to(self.device)
        else:
            ones = torch.ones((len(batch.active), 1), dtype=torch.long, device=self.device)
            attention_mask = torch.cat([batch.attention_mask, ones], dim=1)
            out = self.model(
                input_ids=batch.last_token_ids,
                attention_mask=attention_mask,
                position_ids=batch.next_positions[:, None],
                past_key_values=batch.cache,
                use_cache=True,
                logits_to_keep=1,
            )
            batch.cache = out.past_key_values
            batch.attention_mask = attention_mask
            batch.next_positions = batch.next_positions + 1
        return out.logits[:, -1, :].float()

    @torch.inference_mode()
    def _sample(self, logits: torch.Tensor, batch: _Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one token per row and return ``(token_ids [B] long, logprobs [B] float32)``.

        ``logprobs`` = ``log_softmax(logits / T)`` over non-banned ids, at the sampled id
        (before top-p truncation) -- the behaviour log-prob documented in ``rollout.base``.
        """
        if batch.banned_mask is not None:
            logits = logits.masked_fill(batch.banned_mask, float("-inf"))
        logprobs_all = torch.log_softmax(logits / batch.temperatures, dim=-1)  # [B, V]
        probs = logprobs_all.exp()

        truncate = batch.top_p < 1.0
        if bool(truncate.any()):
            probs = self._apply_top_p(probs, batch.top_p, truncate)

        # Inverse-CDF sampling with one uniform per row from that request's own stream, all rows in one
        # batched computation; a request's draws do not depend on the other rows of the batch.
        uniforms = stream_uniforms(batch.stream_keys, batch.draws)
        cdf = probs.double().cumsum(dim=-1)  # [B, V]
        targets = (uniforms * cdf[:, -1]).unsqueeze(1)
        # right=True returns the first index whose cdf exceeds the target, which always has
        # a strictly positive probability: zero-probability (banned) ids are never chosen.
        token_ids = torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=self.vocab_size - 1)
        # Guard against float rounding landing on a zero-probability id at the very end.
        landed_on_zero = probs.gather(1, token_ids[:, None]).squeeze(1) <= 0
        if bool(landed_on_zero.any()):
            token_ids = torch.where(landed_on_zero, probs.argmax(dim=-1), token_ids)
        token_ids = torch.where(batch.greedy, logits.argmax(dim=-1), token_ids)
        logprobs = logprobs_all.gather(1, token_ids[:, None]).squeeze(1)
        return token_ids, logprobs

    @staticmethod
    def _apply_top_p(probs: torch.Tensor, top_p: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Zero the tail of each row in ``rows`` beyond nucleus mass ``top_p``. Shapes [B, V]."""
        sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Drop a token once the more likely tokens already reach top_p; the top token has
        # mass_before == 0 < top_p and is always kept.
        drop_sorted = (mass_before >= top_p[:, None]) & rows[:, None]
        drop = torch.zeros_like(drop_sorted).scatter_(1, sorted_ids, drop_sorted)
        return probs.masked_fill(drop, 0.0)

    def _decode_one_token(self) -> list[GenerationOutput]:
        """One forward + sample for every unfinished sequence; returns those that finished."""
        batch = self._batch
        logits = self._forward_next_logits(batch)
        token_ids, logprobs = self._sample(logits, batch)
        version = self._version  # only this thread changes it while stepping
        sampled = token_ids.tolist()
        sampled_logprobs = logprobs.tolist()

        finished, keep_rows = [], []
        for row, seq_index in enumerate(batch.active):
            seq = batch.sequences[seq_index]
            token_id = sampled[row]
            seq.token_ids.append(token_id)
            seq.logprobs.append(sampled_logprobs[row])
            seq.versions.append(version)
            self._check_finished(seq, token_id)
            if seq.finish_reason is None:
                keep_rows.append(row)
            else:
                finished.append(self._to_output(seq))
        batch.last_token_ids = token_ids[:, None]
        batch.draws = batch.draws + 1
        batch.num_decode_steps += 1
        self._keep_rows(keep_rows)
        return finished

    def _check_finished(self, seq: _SequenceState, token_id: int) -> None:
        sampling = seq.request.sampling
        if token_id in seq.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token_id
            return
        if sampling.stop_strings:
            # Decode only the tail (a stop string must end in the newest token, earlier
            # matches would have stopped earlier); special tokens are kept so literal
            # markers like "</answer>" or "<|im_end|>" can both be stop strings.
            tail = self.tokenizer.decode(seq.token_ids[-seq.stop_window_tokens:], skip_special_tokens=False)
            for stop in sampling.stop_strings:
                if stop in tail:
                    seq.finish_reason, seq.stop_reason = "stop", stop
                    return
        if len(seq.token_ids) >= seq.token_limit:
            seq.finish_reason = "length"

    def _to_output(self, seq: _SequenceState) -> GenerationOutput:
        if seq.output is not None:
            return seq.output
        output = GenerationOutput(
            request_id=seq.request.request_id,
            prompt_ids=list(seq.request.prompt_ids),
            token_ids=list(seq.token_ids),
            logprobs=list(seq.logprobs),
            versions=list(seq.versions),
            finish_reason=seq.finish_reason,
            text=self.tokenizer.decode(seq.token_ids, skip_special_tokens=True),
            stop_reason=seq.stop_reason,
        )
        if seq.finish_reason is not None:
            seq.output = output
        return output


__all__ = ["HFRolloutEngine", "SamplingParams", "GenerationRequest", "GenerationOutput"]
