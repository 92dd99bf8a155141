"""Per-token log-probabilities, entropies and response-aligned forwards of a causal LM.

Layout (the verl one): ``input_ids (bs, T) = [prompt, left-padded to P | response, right-padded to R]``;
the output at column ``t`` predicts token ``t + 1``, so the response-aligned slice of any per-position
output is ``x[:, T - R - 1 : T - 1]`` (:func:`response_slice`). :func:`token_logprobs_from_logits`
reproduces a sampler's distribution exactly (float32, temperature, banned ids at ``-inf``), so it equals
the behaviour log-prob the rollout recorded. :func:`response_token_logprobs` never builds the
``(bs, R, V)`` logits: it applies the LM head in checkpointed chunks (:func:`chunked_head_logprobs`)
inside the model's own call.

Details: docs/engine.md (§5 Log-probs and response alignment).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from async_rl.engine.microbatch import trim_bounds
from async_rl.engine.precision import call_inside_root

BannedIds = Sequence[int] | torch.Tensor | None

# Positions per LM-head chunk: at a 152k vocabulary one float32 chunk of logits is 0.6 GB, small next
# to a 4B model's activations, and large enough that the matmul stays efficient.
DEFAULT_LOGITS_CHUNK_TOKENS = 1024

# Config fields with which a Hugging Face causal LM post-processes its LM-head output; a model that sets
# one of them is run through its own forward (full logits) so nothing is skipped.
_LOGIT_POSTPROCESSING_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _banned_index(banned_token_ids: BannedIds, vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """Return banned ids as a 1-D long tensor on ``device`` (``None`` when nothing is banned)."""
    if banned_token_ids is None:
        return None
    index = torch.as_tensor(banned_token_ids, dtype=torch.long, device=device).flatten()
    if index.numel() == 0:
        return None
    if int(index.min()) < 0 or int(index.max()) >= vocab_size:
        raise ValueError(f"banned_token_ids must lie in [0, {vocab_size}), got {index.tolist()}")
    return index


def scaled_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    banned_token_ids: BannedIds = None,
) -> torch.Tensor:
    """Float32 ``logits / temperature`` with banned ids set to ``-inf``.

    Args:
        logits: (..., V) raw model logits, any float dtype.
        temperature: sampling temperature (> 0).
        banned_token_ids: token ids the sampler can never emit.

    Returns:
        (..., V) float32 tensor. ``index_fill`` is out of place, so the gradient w.r.t. the
        banned logits is exactly zero (they do not influence the distribution).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    # float32 because rollout engines compute sampling log-probs in float32; doing the
    # softmax in bf16 would make the importance ratio drift away from 1 on-policy.
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    banned = _banned_index(banned_token_ids, scaled.shape[-1], scaled.device)
    if banned is not None:
        scaled = scaled.index_fill(-1, banned, float("-inf"))
    return scaled


def _label_logprobs(scaled: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # gather - logsumexp == log_softmax at the label, without materialising a second (..., V)
    # log_softmax tensor.
    label_logits = scaled.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    return label_logits - torch.logsumexp(scaled, dim=-1)


def _entropy(scaled: torch.Tensor) -> torch.Tensor:
    log_normaliser = torch.logsumexp(scaled, dim=-1, keepdim=True)
    probs = torch.exp(scaled - log_normaliser)
    # Banned entries are 0 * -inf = nan; they contribute exactly 0 to the entropy.
    finite_scaled = torch.where(torch.isneginf(scaled), torch.zeros_like(scaled), scaled)
    return (log_normaliser - (probs * finite_scaled).sum(dim=-1, keepdim=True)).squeeze(-1)


def token_logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    banned_token_ids: BannedIds = None,
) -> torch.Tensor:
    """Log-probability of each label under ``softmax(logits / temperature)`` minus banned ids.

    Args:
        logits: (bs, T, V) logits already aligned with ``labels`` (position ``t`` of
            ``logits`` is the distribution of ``labels[:, t]``; see :func:`sequence_forward`).
        labels: (bs, T) long token ids.
        temperature: the sampling temperature the tokens were drawn with.
        banned_token_ids: ids excluded from the softmax. A label that is itself banned gets
            ``-inf`` (probability 0), which is what the sampler assigned it.

    Returns:
        (bs, T) float32 log-probabilities. Differentiable w.r.t. ``logits``; banned logits
        receive zero gradient.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} are not aligned")
    return _label_logprobs(scaled_logits(logits, temperature, banned_token_ids), labels)


def entropy_from_logits(
    logits: torch.Tensor,
    banned_token_ids: BannedIds = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` restricted to non-banned ids.

    Args:
        logits: (bs, T, V).
        banned_token_ids: ids excluded from the distribution (probability 0).
        temperature: sampling temperature.

    Returns:
        (bs, T) float32 entropies in nats; finite even with banned ids.
    """
    return _entropy(scaled_logits(logits, temperature, banned_token_ids))


def position_ids_from_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(bs, T) position ids that start at 0 on each row's first real token.

    Left padding must not shift positions: the rollout engine saw the prompt without its
    padding, so position ``k`` of the real text has to get rotary position ``k`` here too.
    Left padding gets 0 and right padding repeats the last real position (verl's
    ``clip(cumsum(mask) - 1, 0)``); both are masked out of attention anyway.
    """
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def response_slice(per_position: torch.Tensor, response_len: int) -> torch.Tensor:
    """Select the outputs that predict the response tokens.

    Args:
        per_position: (bs, T, ...) any per-position output (logits, hidden states, values).
        response_len: R, the width of the response slot at the end of the sequence.

    Returns:
        (bs, R, ...) where entry ``j`` is the output at column ``T - R - 1 + j``, the
        position that predicts (or, for a critic, values the state before) response token ``j``.
    """
    seq_len = per_position.shape[1]
    if not 0 < response_len < seq_len:
        raise ValueError(
            f"response_len must be in (0, {seq_len}) for a sequence of length {seq_len}, got {response_len}")
    return per_position[:, seq_len - response_len - 1 : seq_len - 1]


def _accepts_kwarg(module: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def sequence_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
) -> torch.Tensor:
    """Run a causal LM on prompt + response and return the response-aligned logits.

    Args:
        model: an HF-style causal LM (``model(input_ids=..., attention_mask=...,
            position_ids=...)`` returning ``.logits``), plain or FSDP-wrapped.
        input_ids: (bs, T) prompt (left-padded) followed by response (right-padded).
        attention_mask: (bs, T) 1 on real tokens.
        response_len: R, the width of the response slot (the last R columns).

    Returns:
        (bs, R, V) logits; ``logits[:, j]`` is the distribution of ``input_ids[:, T - R + j]``
        (shifted by one: the output at column ``t`` predicts token ``t + 1``).
    """
    seq_len = input_ids.shape[1]
    if not 0 < response_len < seq_len:
        raise ValueError(f"response_len must be in (0, {seq_len}), got {response_len}")
    kwargs = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_attention_mask(attention_mask),
        "use_cache": False,
    }
    # Only the last R + 1 positions are needed; HF causal LMs can skip the LM head (a
    # (bs, T, V) matmul, the largest activation) for the prompt.
    keeps_tail = _accepts_kwarg(model, "logits_to_keep")
    if keeps_tail:
        kwargs["logits_to_keep"] = response_len + 1
    logits = model(**kwargs).logits
    if keeps_tail:
        return logits[:, :-1]
    return response_slice(logits, response_len)


def causal_lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
    """``(backbone, lm_head)`` of a Hugging Face causal LM whose logits are exactly ``lm_head(hidden)``.

    ``backbone`` is ``model.base_model`` (returns ``last_hidden_state``, final norm applied) and
    ``lm_head`` the ``nn.Linear`` from ``get_output_embeddings()``. ``None`` when the model is not
    built that way or post-processes its logits (soft-capping, logit scaling): callers then use the
    model's own forward.
    """
    backbone = getattr(model, "base_model", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if backbone is None or backbone is model or get_head is None:
        return None
    head = get_head()
    if not isinstance(head, nn.Linear):
        return None
    config = getattr(model, "config", None)
    for name in _LOGIT_POSTPROCESSING_FIELDS:
        value = getattr(config, name, None)
        if value is not None and value != 1.0 and value != 1:
            return None
    return backbone, head


def backbone_hidden(backbone: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(bs, T, H) last hidden states with the position ids of :func:`position_ids_from_attention_mask`."""
    return backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_attention_mask(attention_mask),
        use_cache=False,
    ).last_hidden_state


def _chunk_scores(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    banned: torch.Tensor | None,
    with_entropy: bool,
) -> torch.Tensor:
    """(n,) or (n, 2) [log-prob, entropy] of one chunk of positions: hidden (n, H), labels (n,)."""
    scaled = scaled_logits(F.linear(hidden, weight, bias), temperature, banned)  # (n, V) float32
    logprobs = _label_logprobs(scaled, labels)
    if not with_entropy:
        return logprobs
    return torch.stack([logprobs, _entropy(scaled)], dim=-1)


def chunked_head_logprobs(
    hidden: torch.Tensor,
    head: nn.Linear,
    labels: torch.Tensor,
    temperature: float = 1.0,
    banned_token_ids: BannedIds = None,
    with_entropy: bool = False,
    chunk_tokens: int = DEFAULT_LOGITS_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of ``labels`` under ``head(hidden)``, ``chunk_tokens`` positions at a time.

    Equal to ``token_logprobs_from_logits(head(hidden), labels, temperature, banned)`` (and
    :func:`entropy_from_logits`), but only one ``(chunk_tokens, V)`` block of logits exists at a time,
    in forward and -- through a non-reentrant checkpoint per chunk -- in backward.

    Args:
        hidden: (bs, R, H) hidden states aligned with ``labels`` (position ``j`` predicts ``labels[:, j]``).
        head: the LM head (``nn.Linear(H, V)``).
        labels: (bs, R) token ids.
        temperature, banned_token_ids: the sampler's settings (as :func:`scaled_logits`).
        with_entropy: also return the entropy of the same restricted distribution.
        chunk_tokens: positions per chunk (>= 1).

    Returns:
        ``(logprobs, entropy)``: (bs, R) float32 each; ``entropy`` is ``None`` unless ``with_entropy``.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} are not aligned")
    batch_size, response_len, hidden_size = hidden.shape
    weight, bias = head.weight, head.bias
    banned = _banned_index(banned_token_ids, weight.shape[0], hidden.device)
    flat_hidden = hidden.reshape(batch_size * response_len, hidden_size)
    flat_labels = labels.reshape(batch_size * response_len).long()
    # Recompute in backward only when there is a backward: under no_grad a plain loop already frees
    # each chunk's logits.
    recompute = torch.is_grad_enabled() and (flat_hidden.requires_grad or weight.requires_grad)
    pieces = []
    for begin in range(0, flat_hidden.shape[0], chunk_tokens):
        args = (flat_hidden[begin:begin + chunk_tokens], flat_labels[begin:begin + chunk_tokens], weight, bias,
                temperature, banned, with_entropy)
        pieces.append(checkpoint(_chunk_scores, *args, use_reentrant=False) if recompute else _chunk_scores(*args))
    scores = torch.cat(pieces, dim=0)
    if not with_entropy:
        return scores.reshape(batch_size, response_len), None
    scores = scores.reshape(batch_size, response_len, 2)
    return scores[..., 0], scores[..., 1]


def _pad_columns(tensor: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """Zero-pad dim 1 of a (bs, W, ...) tensor by ``left`` / ``right`` columns."""
    if left == 0 and right == 0:
        return tensor
    pad = [0, 0] * (tensor.dim() - 2) + [left, right]
    return F.pad(tensor, pad)


def _response_scores_inside(
    module: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    banned_token_ids: BannedIds,
    with_entropy: bool,
    chunk_tokens: int,
):
    backbone, head = causal_lm_parts(module)
    hidden = response_slice(backbone_hidden(backbone, input_ids, attention_mask), labels.shape[1])
    return chunked_head_logprobs(hidden, head, labels, temperature, banned_token_ids, with_entropy, chunk_tokens)


def response_token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    temperature: float = 1.0,
    banned_token_ids: BannedIds = None,
    with_entropy: bool = False,
    chunk_tokens: int | None = DEFAULT_LOGITS_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and optionally entropies) of the response tokens under ``model``.

    Args: as :func:`sequence_forward` plus the sampler's ``temperature`` and ``banned_token_ids``;
        ``chunk_tokens``: LM-head positions per chunk (see the module docstring); ``None`` runs the
        model's own forward and materialises the (bs, R, V) logits (also used automatically for a
        model :func:`causal_lm_parts` cannot split).

    Returns:
        ``(logprobs, entropy)``: (bs, R) float32 each; ``entropy`` is ``None`` unless
        ``with_entropy``. Padding positions of the response (``attention_mask`` 0) are 0.
    """
    seq_len = input_ids.shape[1]
    if not 0 < response_len < seq_len:
        raise ValueError(f"response_len must be in (0, {seq_len}), got {response_len}")
    prompt_len = seq_len - response_len
    start, stop = trim_bounds(attention_mask, response_len)
    input_ids, attention_mask = input_ids[:, start:stop], attention_mask[:, start:stop]
    kept_response = stop - prompt_len
    responses = input_ids[:, -kept_response:]
    if chunk_tokens is not None and causal_lm_parts(model) is not None:
        logprobs, entropy = call_inside_root(
            model, _response_scores_inside, input_ids=input_ids, attention_mask=attention_mask, labels=responses,
            temperature=temperature, banned_token_ids=banned_token_ids, with_entropy=with_entropy,
            chunk_tokens=chunk_tokens,
        )
    else:
        logits = sequence_forward(model, input_ids, attention_mask, kept_response)
        logprobs = token_logprobs_from_logits(logits, responses, temperature, banned_token_ids)
        entropy = entropy_from_logits(logits, banned_token_ids, temperature) if with_entropy else None
    dropped = response_len - kept_response
    # 0 on padding: a row's padding then reads the same whatever else shares its micro-batch (the columns
    # computed depend on the other rows), and a padding label can never put -inf or nan into a masked sum
    real = attention_mask[:, -kept_response:] > 0
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    logprobs = _pad_columns(torch.where(real, logprobs, zero), 0, dropped)
    entropy = _pad_columns(torch.where(real, entropy, zero), 0, dropped) if entropy is not None else None
    return logprobs, entropy
