"""Rollout (generation) engine interface, shaped like vLLM's so backends are swappable.

A backend turns :class:`GenerationRequest` s into :class:`GenerationOutput` s and can swap in new policy
weights while it is generating (:meth:`RolloutEngine.update_weights`, asynchronous RL). For every generated
token it records what the trainer needs for off-policy correction: ``logprobs[i]``, the *behaviour log-prob*
of ``token_ids[i]`` under the untruncated tempered distribution (top-p does not change it), and
``versions[i]``, the policy version whose weights sampled it.

Details: docs/rollout.md (2. The interface; "What logprobs[i] is").
"""

from __future__ import annotations

import abc
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Protocol, runtime_checkable

import torch

FinishReason = Literal["stop", "length", "aborted"]
# A state dict or a stream of (parameter name, tensor) pairs, as a trainer sends them.
WeightsLike = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (names follow ``vllm.SamplingParams`` where they overlap).

    Attributes:
        temperature: softmax temperature ``T``; ``0`` means greedy (argmax).
        top_p: nucleus sampling; sample from the smallest set of tokens whose tempered
            probability mass reaches ``top_p``. ``1.0`` disables it.
        max_new_tokens: generate at most this many tokens (vLLM: ``max_tokens``); fewer if the
            context would exceed the model's ``max_position_embeddings`` (then "length").
        stop_strings: stop as soon as the decoded generated text contains one of these
            (vLLM: ``stop``). The token that completes the string is kept.
        stop_token_ids: extra token ids that end generation (kept in the output).
        ignore_eos: if False (default), the tokenizer's / generation config's eos ids also
            end generation, like vLLM.
        banned_token_ids: ids that can never be sampled; their logits are set to ``-inf``
            before sampling and log-probs are normalised over the remaining ids.
        seed: keys this request's own random stream, so the same request with the
            same seed and weights reproduces its tokens. ``None`` draws a seed from
            torch's global RNG (reproducible after ``torch.manual_seed``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    banned_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Accept lists for convenience but store tuples so the params stay hashable/frozen.
        for name in ("stop_strings", "stop_token_ids", "banned_token_ids"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise TypeError(f"SamplingParams.{name} must be a sequence, not the string {value!r}")
            object.__setattr__(self, name, tuple(value))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(s == "" for s in self.stop_strings):
            raise ValueError("stop_strings must not contain the empty string")

    @property
    def logprob_temperature(self) -> float:
        """The ``T`` used for recorded log-probs: ``temperature``, or 1 for greedy."""
        return self.temperature if self.temperature > 0 else 1.0


@dataclass
class GenerationRequest:
    """One prompt to complete.

    ``prompt_ids`` is the full token context, so a multi-turn conversation is continued by
    passing previous turns (prompt + generated tokens + new observation) as the prompt.
    """

    request_id: Hashable
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class GenerationOutput:
    """The completion of one :class:`GenerationRequest`.

    ``token_ids``, ``logprobs`` and ``versions`` have one entry per generated token (see
    the module docstring for exactly what ``logprobs`` and ``versions`` are).

    Attributes:
        finish_reason: ``"stop"`` (stop string or stop/eos token), ``"length"``
            (``max_new_tokens`` reached) or ``"aborted"``.
        text: ``tokenizer.decode(token_ids, skip_special_tokens=True)``; a matched stop
            string is included (unlike vLLM's default) so text and tokens agree.
        stop_reason: the stop string or token id that ended generation, else ``None``.
    """

    request_id: Hashable
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    text: str
    stop_reason: str | int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class RolloutEngine(abc.ABC):
    """Generates completions and accepts new policy weights while generating.

    Backends (transformers: :class:`async_rl.rollout.hf_engine.HFRolloutEngine`; a vLLM one
    can be added later) implement:

    * :meth:`generate` -- run requests to completion;
    * :meth:`update_weights` -- load new weights and set :attr:`policy_version`; if called
      while :meth:`generate` is running (from another thread), the update is applied at
      the next token boundary and later tokens are sampled (and tagged) with the new
      version;
    * :meth:`pause` / :meth:`resume` -- hold the decode loop at a token boundary (e.g. to
      update weights atomically between several calls).
    """

    @property
    @abc.abstractmethod
    def policy_version(self) -> int:
        """Version of the weights currently used for sampling."""

    @abc.abstractmethod
    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        """Complete all ``requests``; outputs are returned in request order."""

    @abc.abstractmethod
    def update_weights(self, state_dict: WeightsLike, version: int) -> None:
        """Load new weights (full or partial state dict) and set ``policy_version = version``."""

    @abc.abstractmethod
    def pause(self) -> None:
        """Stop generating at the next token boundary until :meth:`resume`."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Undo :meth:`pause`."""


@runtime_checkable
class RolloutService(Protocol):
    """The rollout contract: everything the driver calls on its rollout (``driver/rollout_manager.py`` streams
    episodes through it, ``driver/core.py`` and the schedulers publish weights and checkpoint it). Implemented
    alike by the in-process :class:`~async_rl.rollout.hf_engine.HFRolloutEngine` and by
    :class:`~async_rl.rollout.pool.ReplicaPool` (replica servers, hf or vLLM, on Ray);
    ``tests/test_rollout_contract.py`` runs the driver against each through a guard that refuses anything else.

    Optional capabilities, read with ``getattr`` and a default: ``takes_version_only`` / ``accepts_published_weights``
    (how weights travel: ``rollout/publication.py``), ``metrics()`` (per-step rollout metrics), ``max_positions``
    (the context limit an episode is cut at; the builder, ``assemble.py``, reads it from the engine it made).
    """

    @property
    def policy_version(self) -> int:
        """The version of the weights new tokens are sampled with."""

    @property
    def has_unfinished(self) -> bool:
        """Whether any request is still generating (or held)."""

    def add_requests(self, requests: Sequence[GenerationRequest]) -> None:
        """Start ``requests`` (ids unique among the unfinished ones)."""

    def step(self, max_tokens: Optional[int] = None) -> list[GenerationOutput]:
        """Advance generation (about ``max_tokens`` tokens a request where the engine steps in chunks); the requests
        that finished since the last call."""

    def abort(self, request_ids: Optional[Iterable[Hashable]] = None) -> list[GenerationOutput]:
        """Stop these requests (None: all); each comes back once, ``finish_reason="aborted"``, with its tokens."""

    def update_weights(self, weights: Any, version: int) -> None:
        """Take the policy of ``version`` (what ``publication.weights_to_publish`` made for this rollout); unfinished
        requests keep their tokens and go on under the new weights from the next token boundary."""

    def export_inflight(self) -> list[dict]:
        """The unfinished requests with their kept prefixes (token ids, log-probs, versions), for a checkpoint."""

    def import_inflight(self, states: list[dict]) -> None:
        """Resubmit :meth:`export_inflight`'s requests, each continuing from its prefix (a resumed run)."""


#: the members of :class:`RolloutService`, and the optional capabilities its users read with ``getattr``
ROLLOUT_CONTRACT: tuple[str, ...] = ("policy_version", "has_unfinished", "add_requests", "step", "abort",
                                     "update_weights", "export_inflight", "import_inflight")
ROLLOUT_OPTIONAL: tuple[str, ...] = ("takes_version_only", "accepts_published_weights", "metrics", "max_positions")
