"""The SAPO role (spec §5; sapo paper §4): one causal LM is the policy, the state value V and the action
value Q. Entry points: :class:`SapoRole`, :func:`resolve_reserved_ids`, :func:`default_reserved_ids`.

V and Q are read from the logits of two reserved ids in the same forward as the log-probs: ``V(s_k)`` at
the column before turn ``k``'s first action token, ``Q(s_k, a_k)`` at its last action token. The policy
softmax (log-probs, entropy) excludes the two ids, exactly like the rollout sampler that bans them. As in
:mod:`async_rl.workers.roles`, no Ray here; every loss is a local sum divided by a count summed over the
data-parallel group, so shards give the full-batch gradient.

Details: docs/sapo.md (Where V and Q are read; The restricted policy; The joint loss; Defaults and why).
"""

from __future__ import annotations

import copy
import inspect
import logging
from typing import Any, Mapping, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from async_rl.algos.sapo import normalised_readout, num_turns_of, ppo_clip_token_loss, turn_boundaries, turn_value_loss
from async_rl.engine import dist
from async_rl.engine.base import GlobalDenominator, OptimizerConfig
from async_rl.engine.fsdp import FSDPEngine
from async_rl.engine.microbatch import MicroBatchPlan, trim_bounds
from async_rl.engine.precision import call_inside_root
from async_rl.models.loading import load_causal_lm
from async_rl.models.logprobs import (
    DEFAULT_LOGITS_CHUNK_TOKENS,
    backbone_hidden,
    causal_lm_parts,
    chunked_head_logprobs,
    entropy_from_logits,
    position_ids_from_attention_mask,
    token_logprobs_from_logits,
)
from async_rl.workers.proto import MODEL_INPUT_KEYS
from async_rl.workers.role_calls import ARG_PREFIX, RemoteCall
from async_rl.workers.roles import EngineCheckpoints

logger = logging.getLogger(__name__)

DEFAULT_RESERVED_TOKENS: tuple[str, str] = ("<|value_plus|>", "<|value_minus|>")
AUTO_RESERVED = "auto"

# Defaults for the values the paper does not give; identical to the ``sapo_*`` fields of
# :class:`async_rl.config.AlgorithmConfig` (the justification is in docs/sapo.md).
SAPO_DEFAULTS: dict[str, float] = {
    "tau_v": 5.0,
    "r_max": 1.0,
    "clip_eps": 0.2,
    "clip_v": 0.2,
    "clip_q": 0.2,
    "c_v": 0.5,
    "c_q": 0.5,
    "c_h": 0.0,
    "kl_coef": 0.01,
}

# Bound on ``ref - lp`` before the exponential of the k3 estimator (a token whose log-prob moved by more
# than this is an outlier either way) and on the per-token k3 value (verl's low_var_kl clamps to 10).
_KL_LOGRATIO_CLAMP = 20.0
_KL_VALUE_CLAMP = 10.0


# ----------------------------------------------------------------------------------------------------
# reserved ids
# ----------------------------------------------------------------------------------------------------
def _special_ids(tokenizer) -> set[int]:
    return {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or ())} | _core_ids(tokenizer)


def _added_ids(tokenizer) -> set[int]:
    """Ids of every added token (special or not: chat-template markers such as ``<tool_call>``)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {int(i) for i in decoder}


def _core_ids(tokenizer) -> set[int]:
    """eos, pad, bos and unk: tokens a conversation uses even when the chat template does not spell them."""
    ids: set[int] = set()
    for name in ("eos_token_id", "pad_token_id", "bos_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def _template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # several named templates (tool use, RAG)
        template = "\n".join(str(v) for v in template.values())
    return str(template)


def unused_special_ids(tokenizer) -> list[int]:
    """Added special tokens no conversation uses, highest id first: flagged special, not eos / pad / bos / unk, and
    not written anywhere in the chat template (SmolLM2's ``<jupyter_script>``, ``<empty_output>``, ...: pretraining
    markers of code files; Qwen2.5's vision and FIM markers)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    core, template, size = _core_ids(tokenizer), _template_text(tokenizer), len(tokenizer)
    unused = []
    for token_id, token in decoder.items():
        token_id, text = int(token_id), str(getattr(token, "content", token))
        if getattr(token, "special", False) and token_id not in core and 0 <= token_id < size \
                and text and text not in template:
            unused.append(token_id)
    return sorted(unused, reverse=True)


def default_reserved_ids(tokenizer) -> tuple[int, int]:
    """Pick ``(w+, w-)`` for a tokenizer without dedicated value tokens.

    Rule, for any model:

    1. the two highest **unused special tokens** (:func:`unused_special_ids`): added tokens flagged special that
       are not eos / pad / bos / unk and that the chat template never writes. A chat never produces them, so
       banning them from sampling takes no probability a conversation needs, and with tied embeddings training
       their rows as the value readout changes no input a prompt contains. The lower id is w+. SmolLM2:
       ``(15, 16)`` = ``<jupyter_script>``, ``<empty_output>``; the tiny test tokenizer: its value tokens (3, 4).
    2. otherwise (fewer than two such tokens) the **last two ordinary ids**: scanning down from
       ``len(tokenizer) - 1``, the first two ids that are neither a special token (eos, pad, bos, unk,
       ``all_special_ids``) nor any added token (chat markers, tool tags); in a BPE vocabulary the last merges
       learned, the rarest pieces.
    """
    unused = unused_special_ids(tokenizer)
    if len(unused) >= 2:
        return unused[1], unused[0]  # the lower id is w+
    vocab_size = len(tokenizer)
    excluded = _special_ids(tokenizer) | _added_ids(tokenizer)
    picked: list[int] = []
    for token_id in range(vocab_size - 1, -1, -1):
        if token_id not in excluded:
            picked.append(token_id)
            if len(picked) == 2:
                return picked[0], picked[1]
    raise ValueError(f"the tokenizer has fewer than two ordinary (non-special, non-added) ids among {vocab_size}")


def resolve_reserved_ids(
    tokenizer,
    reserved: Union[Sequence[Union[str, int]], str, None] = DEFAULT_RESERVED_TOKENS,
) -> tuple[int, int]:
    """Resolve the value basis ``(w+, w-)`` to token ids.

    Args:
        tokenizer: a Hugging Face tokenizer (for the vocabulary and its eos / pad ids).
        reserved: two token strings or ids (mixed is fine), or ``None`` / ``"auto"`` for
            :func:`default_reserved_ids`. With the default names (``<|value_plus|>``, ``<|value_minus|>``)
            and a tokenizer that lacks them (e.g. stock Qwen2.5), the default picker is used and a
            warning logged; any *other* missing name is an error.

    Returns:
        ``(plus_id, minus_id)``.

    Raises:
        ValueError: a token is not in the vocabulary, an id is out of range, the two coincide, or one of
            them is the eos / pad token (banning it from the policy would make the model unable to stop,
            and padding would carry a value readout).
    """
    if reserved is None or (isinstance(reserved, str) and reserved == AUTO_RESERVED):
        return default_reserved_ids(tokenizer)
    if isinstance(reserved, str):
        raise ValueError(f"reserved must be two tokens (or 'auto'), got the single string {reserved!r}")
    reserved = list(reserved)
    if len(reserved) != 2:
        raise ValueError(f"reserved must name exactly two tokens (w+, w-), got {len(reserved)}: {reserved}")

    vocab = tokenizer.get_vocab()
    vocab_size = len(tokenizer)
    missing = [r for r in reserved if isinstance(r, str) and r not in vocab]
    if missing:
        if tuple(reserved) == DEFAULT_RESERVED_TOKENS:
            ids = default_reserved_ids(tokenizer)
            logger.warning("tokenizer has no %s: SAPO reads values from ids %s (%s), default_reserved_ids' rule",
                           missing, ids, tokenizer.convert_ids_to_tokens(list(ids)))
            return ids
        raise ValueError(
            f"reserved value tokens {missing} are not in the tokenizer's vocabulary ({vocab_size} entries); "
            f"pass existing tokens, token ids, or 'auto' to pick two rarely used ids"
        )

    ids: list[int] = []
    for r in reserved:
        if isinstance(r, str):
            ids.append(int(vocab[r]))
        elif isinstance(r, (int,)) and not isinstance(r, bool):
            ids.append(int(r))
        elif torch.is_tensor(r) and r.numel() == 1:
            ids.append(int(r))
        else:
            raise ValueError(f"a reserved token must be a string or an int id, got {r!r} ({type(r).__name__})")
    for token_id in ids:
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"reserved id {token_id} is outside the vocabulary [0, {vocab_size})")
    if ids[0] == ids[1]:
        raise ValueError(f"w+ and w- must be two different tokens, both are id {ids[0]}")
    forbidden = {}
    for name in ("eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            forbidden[value] = name
    for token_id in ids:
        if token_id in forbidden:
            raise ValueError(
                f"reserved id {token_id} ({tokenizer.convert_ids_to_tokens(token_id)!r}) is the tokenizer's "
                f"{forbidden[token_id]}: the policy could never emit it (or padding would be read as a value); "
                f"choose two other tokens"
            )
    return ids[0], ids[1]


# ----------------------------------------------------------------------------------------------------
# batch helpers
# ----------------------------------------------------------------------------------------------------
def _rows(tensors: Mapping[str, Any], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[rows] for k, v in tensors.items() if torch.is_tensor(v) and v.dim() > 0}


def _accepts_kwarg(module: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


# ----------------------------------------------------------------------------------------------------
# the role
# ----------------------------------------------------------------------------------------------------
class SapoRole(EngineCheckpoints):
    """Policy, V and Q on one backbone, trained with one joint loss (spec §5).

    Args:
        model_or_path: a causal LM or the path of a local checkpoint.
        optim: AdamW settings (paper: lr 1e-6).
        reserved_ids: ``(w+, w-)`` token ids (see :func:`resolve_reserved_ids`). The rollout must ban
            them (:attr:`banned_token_ids`), and the policy softmax here excludes them.
        tau_v: τ_v of the readout ``p = clip((z+ - z-)/τ_v, -1, 1)``.
        r_max: R_max, ``V = R_max p``.
        temperature: the rollout's sampling temperature (log-probs and entropy use it, as the sampler).
        micro_batch_size: row cap per forward/backward (gradients accumulate); ``None`` = no cap.
        ref_model: the frozen reference policy of the KL term: a model or path; ``None`` = a colocated
            frozen copy of the initial model when ``kl_coef > 0`` (no reference when ``kl_coef == 0``).
        kl_coef: β, the default of :meth:`update`'s ``kl_coef``.
        precision: ``"fp32"`` | ``"bf16"`` (fp32 master weights either way; :class:`FSDPEngine`).
        max_tokens_per_micro_batch: padded-token budget per micro-batch
            (:mod:`async_rl.engine.microbatch`); ``None`` = none.
        activation_checkpointing: recompute decoder blocks in backward.
        logits_chunk_tokens: LM-head positions per chunk for log-probs, entropy and the two readout
            logits (:func:`~async_rl.models.logprobs.chunked_head_logprobs`); ``None`` = full logits.
    """

    # the learner's calls, also on a worker group (workers/role_calls.py); ``update`` all-reduces its own metrics
    REMOTE_CALLS = {
        "readouts": RemoteCall(required=MODEL_INPUT_KEYS + ("response_mask", "token_turn_index")),
        "update": RemoteCall(required=MODEL_INPUT_KEYS + ("response_mask", "behaviour_log_probs", "token_turn_index"),
                             trains=True, reduce_metrics=False,
                             zero_keys=("response_mask", f"{ARG_PREFIX}turns__turn_mask",
                                        f"{ARG_PREFIX}targets__turn_mask", f"{ARG_PREFIX}targets__token_advantages")),
    }

    def __init__(
        self,
        model_or_path,
        optim: Optional[OptimizerConfig] = None,
        reserved_ids: Sequence[int] = (),
        tau_v: float = SAPO_DEFAULTS["tau_v"],
        r_max: float = SAPO_DEFAULTS["r_max"],
        temperature: float = 1.0,
        micro_batch_size: Optional[int] = None,
        ref_model=None,
        kl_coef: float = SAPO_DEFAULTS["kl_coef"],
        precision: str = "fp32",
        max_tokens_per_micro_batch: Optional[int] = None,
        activation_checkpointing: bool = False,
        logits_chunk_tokens: Optional[int] = DEFAULT_LOGITS_CHUNK_TOKENS,
    ):
        if tau_v <= 0 or r_max <= 0:
            raise ValueError(f"tau_v and r_max must be > 0, got tau_v={tau_v}, r_max={r_max}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        reserved_ids = tuple(int(i) for i in reserved_ids)
        if len(reserved_ids) != 2 or reserved_ids[0] == reserved_ids[1]:
            raise ValueError(f"reserved_ids must be two different ids (w+, w-), got {reserved_ids}")
        model = self._load(model_or_path)
        vocab_size = self._vocab_size(model)
        if not all(0 <= i < vocab_size for i in reserved_ids):
            raise ValueError(f"reserved ids {reserved_ids} are outside the model's vocabulary [0, {vocab_size})")

        self.reserved_ids: tuple[int, int] = reserved_ids  # (w+, w-)
        self.tau_v = float(tau_v)
        self.r_max = float(r_max)
        self.temperature = float(temperature)
        self.micro_batch_size = micro_batch_size
        self.micro_batching = MicroBatchPlan(max_tokens=max_tokens_per_micro_batch, max_rows=micro_batch_size)
        self.logits_chunk_tokens = logits_chunk_tokens
        self.kl_coef = float(kl_coef)

        self.ref_model: Optional[nn.Module] = None
        if ref_model is not None:
            self.ref_model = self._load(ref_model)
        elif self.kl_coef > 0:
            self.ref_model = copy.deepcopy(model)  # before the engine touches (or shards) the model
        self.engine = FSDPEngine(model, optim or OptimizerConfig(), precision=precision,
                                 activation_checkpointing=activation_checkpointing)
        if self.ref_model is not None:
            # frozen: no master copy needed, so it is stored in the compute dtype (half the bytes in bf16);
            # rounding the same fp32 weights gives the same bf16 values the policy's autocast uses
            self.ref_model.to(device=self.engine.device, dtype=self.engine.compute_dtype).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)

    # -- construction helpers -------------------------------------------------------------------
    @staticmethod
    def _load(model_or_path) -> nn.Module:
        if isinstance(model_or_path, (str, bytes)) or hasattr(model_or_path, "__fspath__"):
            return load_causal_lm(model_or_path)
        return model_or_path

    @staticmethod
    def _vocab_size(model: nn.Module) -> int:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is not None and hasattr(head, "out_features"):
            return int(head.out_features)
        return int(model.config.vocab_size)

    @property
    def banned_token_ids(self) -> tuple[int, int]:
        """The ids the rollout sampler must ban (``SamplingParams.banned_token_ids``)."""
        return self.reserved_ids

    # -- forward --------------------------------------------------------------------------------
    def _tail_inside(self, module: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     labels: torch.Tensor):
        """Body run inside ``module(...)``: chunked restricted log-probs / entropy and the two readout logits."""
        backbone, head = causal_lm_parts(module)
        kept = labels.shape[1]
        hidden = backbone_hidden(backbone, input_ids, attention_mask)[:, -(kept + 1):]  # (bs, kept + 1, H)
        lp, ent = chunked_head_logprobs(hidden[:, :-1], head, labels, self.temperature, self.reserved_ids,
                                        True, self.logits_chunk_tokens)
        # the readouts need only rows w+ and w- of the LM head: (bs, kept + 1, 2), never the vocabulary
        index = torch.tensor(self.reserved_ids, device=head.weight.device)
        bias = head.bias[index] if head.bias is not None else None
        basis = F.linear(hidden, head.weight[index], bias).float()
        return lp, ent, basis

    def _tail_outputs(self, model: nn.Module, batch: Mapping[str, torch.Tensor]):
        """One forward over absolute columns ``P - 1 .. P + T - 1`` (the ``T + 1`` tail columns).

        Returns ``(log_probs (bs, T), entropy (bs, T), value_basis (bs, T + 1, 2))``, float32: the
        restricted-softmax log-prob and entropy of each response token (raw, unmasked) and the raw
        logits of ``(w+, w-)`` at each tail column. Columns that are padding in every row are not
        computed (their outputs are 0; they are never read).
        """
        device = self.engine.device
        prompts, responses = batch["prompts"].to(device), batch["responses"].to(device)
        P, T = prompts.shape[1], responses.shape[1]
        if P < 1:
            raise ValueError("SAPO needs a non-empty prompt: V of the first turn is read at its last column")
        input_ids = torch.cat([prompts, responses], dim=1)
        attention = torch.cat([batch["prompt_mask"].to(device), batch["response_attention"].to(device)], dim=1)
        start, stop = trim_bounds(attention, T)  # keeps column P - 1 and at least one response column
        input_ids, attention = input_ids[:, start:stop], attention[:, start:stop]
        kept = stop - P
        labels = responses[:, :kept]
        if self.logits_chunk_tokens is not None and causal_lm_parts(model) is not None:
            lp, ent, basis = call_inside_root(model, self._tail_inside, input_ids=input_ids,
                                              attention_mask=attention, labels=labels)
        else:
            lp, ent, basis = self._scores_from_logits(self._logits(model, input_ids, attention, kept), labels)
        dropped = T - kept
        if dropped:
            lp, ent = F.pad(lp, (0, dropped)), F.pad(ent, (0, dropped))
            basis = F.pad(basis, (0, 0, 0, dropped))
        return lp, ent, basis

    @staticmethod
    def _logits(model: nn.Module, input_ids: torch.Tensor, attention: torch.Tensor, response_len: int) -> torch.Tensor:
        """(bs, R + 1, V) float32 full-vocabulary logits of the last ``R + 1`` columns (the model's forward)."""
        kwargs = {"input_ids": input_ids, "attention_mask": attention,
                  "position_ids": position_ids_from_attention_mask(attention), "use_cache": False}
        if _accepts_kwarg(model, "logits_to_keep"):
            kwargs["logits_to_keep"] = response_len + 1  # skip the LM head on the prompt
        return model(**kwargs).logits[:, -(response_len + 1):].float()

    def _scores_from_logits(self, tail: torch.Tensor, labels: torch.Tensor):
        """:meth:`_tail_outputs`' triple from full tail logits (bs, R + 1, V) and labels (bs, R)."""
        lp = token_logprobs_from_logits(tail[:, :-1], labels, self.temperature, self.reserved_ids)
        ent = entropy_from_logits(tail[:, :-1], self.reserved_ids, self.temperature)
        return lp, ent, tail[..., list(self.reserved_ids)]

    def _tail_logits(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``(bs, T + 1, V)`` float32 logits of absolute columns ``P - 1 .. P + T - 1`` (the unchunked path;
        :meth:`_outputs` accepts them in place of :meth:`_tail_outputs`)."""
        device = self.engine.device
        prompts, responses = batch["prompts"].to(device), batch["responses"].to(device)
        if prompts.shape[1] < 1:
            raise ValueError("SAPO needs a non-empty prompt: V of the first turn is read at its last column")
        input_ids = torch.cat([prompts, responses], dim=1)
        attention = torch.cat([batch["prompt_mask"].to(device), batch["response_attention"].to(device)], dim=1)
        return self._logits(model, input_ids, attention, responses.shape[1])

    def _outputs(
        self, tail, batch: Mapping[str, torch.Tensor], num_turns: int,
    ) -> dict[str, torch.Tensor]:
        """Masked log-probs, entropy and turn readouts from :meth:`_tail_outputs` (or full tail logits)."""
        if torch.is_tensor(tail):
            tail = self._scores_from_logits(tail, batch["responses"].to(tail.device))
        lp, ent, value_basis = tail
        device = lp.device
        model_mask = batch["response_mask"].to(device) > 0
        # off model tokens the label may be anything (even a reserved id -> -inf): zero it there
        zero = torch.zeros((), device=device)
        lp = torch.where(model_mask, lp, zero)
        ent = torch.where(model_mask, ent, zero)

        tti = batch["token_turn_index"].to(device).long()
        first, last = turn_boundaries(tti, num_turns)
        exists = first >= 0
        # value_basis (bs, T + 1, 2): only the two reserved logits
        v_cols = first.clamp_min(0)  # tail column first_k == absolute column P + first_k - 1
        q_cols = (last + 1).clamp_min(0)  # tail column last_k + 1 == absolute column P + last_k
        v_z = value_basis.gather(1, v_cols.unsqueeze(-1).expand(-1, -1, 2))
        q_z = value_basis.gather(1, q_cols.unsqueeze(-1).expand(-1, -1, 2))
        p_v = normalised_readout(v_z[..., 0], v_z[..., 1], self.tau_v) * exists
        p_q = normalised_readout(q_z[..., 0], q_z[..., 1], self.tau_v) * exists
        return {
            "log_probs": lp, "entropy": ent,
            "p_v": p_v, "p_q": p_q, "values": self.r_max * p_v, "q_values": self.r_max * p_q,
            "turn_mask": exists.float(), "turn_first": first, "turn_last": last,
        }

    def forward(self, batch: Mapping[str, torch.Tensor], num_turns: Optional[int] = None) -> dict[str, torch.Tensor]:
        """One forward pass over prompt + response of the whole ``batch`` (grad follows the caller's mode).

        Returns (on the engine's device):
            ``log_probs``, ``entropy``: ``(bs, T)`` restricted-softmax log-prob of each response token and
            entropy at that position (temperature applied, reserved ids excluded; 0 off model tokens);
            ``p_v``, ``p_q``: ``(bs, K)`` normalised readouts in [-1, 1]; ``values``, ``q_values``:
            ``R_max p``; ``turn_mask`` ``(bs, K)`` 1 on turns with model tokens; ``turn_first``,
            ``turn_last``: their response positions (-1 for absent turns).
        """
        K = num_turns or num_turns_of(batch["token_turn_index"])
        return self._outputs(self._tail_outputs(self.engine.module, batch), batch, K)

    @torch.no_grad()
    def evaluate(self, batch: Mapping[str, torch.Tensor], num_turns: Optional[int] = None) -> dict[str, torch.Tensor]:
        """:meth:`forward` without gradients, micro-batched, in eval mode; CPU tensors."""
        K = num_turns or num_turns_of(batch["token_turn_index"])
        with self.engine.eval_context():
            parts = [self.forward(_rows(batch, rows), K) for rows in self.micro_batching.split(batch)]
        return {k: torch.cat([p[k].cpu() for p in parts]) for k in parts[0]}

    @torch.no_grad()
    def reference_log_probs(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``(bs, T)`` restricted log-probs of the response under the frozen reference (0 off model tokens)."""
        if self.ref_model is None:
            raise ValueError("no reference model: construct SapoRole with kl_coef > 0 or pass ref_model")
        out = []
        for rows in self.micro_batching.split(batch):
            mb = _rows(batch, rows)
            with self.engine.compute_context():  # the reference computes like the policy
                lp, _, _ = self._tail_outputs(self.ref_model, mb)
            model_mask = mb["response_mask"].to(lp.device) > 0
            out.append(torch.where(model_mask, lp, torch.zeros((), device=lp.device)).cpu())
        return torch.cat(out)

    # -- targets --------------------------------------------------------------------------------
    def _check_batch(self, batch: Mapping[str, torch.Tensor]) -> None:
        model_tokens = batch["responses"][batch["response_mask"] > 0]
        hit = torch.isin(model_tokens, torch.tensor(self.reserved_ids, dtype=model_tokens.dtype,
                                                    device=model_tokens.device))
        if bool(hit.any()):
            raise ValueError(
                f"a model token is a reserved value id {self.reserved_ids}: the rollout must ban them "
                f"(SamplingParams.banned_token_ids = role.banned_token_ids)"
            )

    @torch.no_grad()
    def readouts(self, batch: Mapping[str, torch.Tensor], num_turns: Optional[int] = None) -> dict[str, torch.Tensor]:
        """The frozen old readouts of one batch (spec §5), read once with the current weights under ``no_grad``:
        SAPO's counterpart of a critic's ``values``. The turn advantage and the targets are computed from them by
        the registered ``sapo_turn`` estimator (``async_rl.driver.learner.shared_backbone_targets``).

        Returns (CPU): ``values`` (V_old), ``q_values`` (Q_old), ``p_v``, ``p_q`` (their normalised readouts),
        ``turn_mask`` (1 on turns with model tokens) — all ``(bs, K)`` — ``log_probs`` ``(bs, T)``, and
        ``ref_log_probs`` ``(bs, T)`` when there is a reference model.
        """
        self._check_batch(batch)
        K = num_turns or num_turns_of(batch["token_turn_index"])
        if num_turns_of(batch["token_turn_index"]) > K:
            raise ValueError(f"the batch has turn indices up to {num_turns_of(batch['token_turn_index']) - 1} "
                             f"but the turn tensors only K={K} turns")
        old = self.evaluate(batch, K)
        out = {key: old[key] for key in ("values", "q_values", "p_v", "p_q", "turn_mask", "log_probs")}
        if self.ref_model is not None:
            out["ref_log_probs"] = self.reference_log_probs(batch)
        return out

    # -- update ---------------------------------------------------------------------------------
    @staticmethod
    def _k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
        """Per-token k3 estimator of KL(π_θ || π_ref): ``exp(ref - lp) - (ref - lp) - 1`` (≥ 0, unbiased,
        low variance; Schulman's k3 / verl's ``low_var_kl``)."""
        d = (ref_log_prob - log_prob).clamp(-_KL_LOGRATIO_CLAMP, _KL_LOGRATIO_CLAMP)
        return (torch.exp(d) - d - 1.0).clamp(max=_KL_VALUE_CLAMP)

    def _micro_losses(
        self,
        mb: Mapping[str, torch.Tensor],
        tg: Mapping[str, torch.Tensor],
        K: int,
        clip_eps: float,
        clip_v: float,
        clip_q: float,
        use_kl: bool,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Local *sums* of every loss term on one micro-batch (graph attached) and side statistics."""
        out = self.forward(mb, K)
        device = out["log_probs"].device
        mask = mb["response_mask"].to(device).float()
        tmask = tg["turn_mask"].to(device).float()
        n_tok, n_turn = mask.sum(), tmask.sum()

        pg, pg_clipfrac = ppo_clip_token_loss(out["log_probs"], mb["behaviour_log_probs"].to(device).float(),
                                              tg["token_advantages"].to(device).float(), mask, clip_eps)
        v_loss, v_clipfrac = turn_value_loss(out["p_v"], tg["p_v_old"].to(device), tg["y_v"].to(device), tmask,
                                             clip_v, self.r_max)
        q_loss, q_clipfrac = turn_value_loss(out["p_q"], tg["p_q_old"].to(device), tg["y_q"].to(device), tmask,
                                             clip_q, self.r_max)
        # the algos functions return means over this micro-batch: back to local sums
        sums = {"pg": pg * n_tok, "v": v_loss * n_turn, "q": q_loss * n_turn,
                "entropy": (out["entropy"] * mask).sum()}
        if use_kl:
            sums["kl"] = (self._k3(out["log_probs"], tg["ref_log_probs"].to(device).float()) * mask).sum()
        else:
            sums["kl"] = torch.zeros((), device=device)
        values = out["values"].detach()
        y_v = tg["y_v"].to(device)
        err = (y_v - values) * tmask
        stats = {
            "pg_clipfrac": pg_clipfrac.detach() * n_tok, "v_clipfrac": v_clipfrac.detach() * n_turn,
            "q_clipfrac": q_clipfrac.detach() * n_turn,
            "ppo_kl": ((mb["behaviour_log_probs"].to(device) - out["log_probs"].detach()) * mask).sum(),
            "v_sum": (values * tmask).sum(), "q_sum": (out["q_values"].detach() * tmask).sum(),
            "y_sum": (y_v * tmask).sum(), "y_sq": (y_v * y_v * tmask).sum(),
            "e_sum": err.sum(), "e_sq": (err * err).sum(),
        }
        return sums, stats

    def update(
        self,
        batch: Mapping[str, torch.Tensor],
        turns: Optional[Mapping[str, torch.Tensor]],
        targets: Mapping[str, torch.Tensor],
        clip_eps: float = SAPO_DEFAULTS["clip_eps"],
        clip_v: float = SAPO_DEFAULTS["clip_v"],
        clip_q: float = SAPO_DEFAULTS["clip_q"],
        c_v: float = SAPO_DEFAULTS["c_v"],
        c_q: float = SAPO_DEFAULTS["c_q"],
        c_h: float = SAPO_DEFAULTS["c_h"],
        kl_coef: Optional[float] = None,
    ) -> dict[str, float]:
        """One optimizer step on ``L_pol + c_V L_V + c_Q L_Q + β L_KL - c_H H`` (one backward per micro-batch).

        ``L_pol``: token-level PPO clip of the restricted log-probs against the batch's
        ``behaviour_log_probs`` (the rollout's, which may mix policy versions), token-mean over model
        tokens. ``L_V``, ``L_Q``: clipped losses in normalised space, mean over valid turns. ``L_KL``: k3
        against ``targets["ref_log_probs"]``, token-mean. ``H``: restricted entropy, token-mean.
        ``targets``: the frozen ones of :func:`async_rl.algos.sapo.sapo_update_targets` (``turn_mask`` combining the
        batch's and the readouts' masks, ``y_v``, ``y_q``, ``p_v_old``, ``p_q_old``, ``token_advantages``, and
        ``ref_log_probs`` when there is a reference); ``turns`` only checks their ``(bs, K)``.

        Returns: ``sapo/loss`` (joint loss before the step), ``sapo/v_loss``, ``sapo/q_loss``, ``sapo/kl``,
        ``sapo/entropy``, ``sapo/explained_var`` (V vs y^V over valid turns; 0 when y^V has no variance),
        ``sapo/v_mean``, ``sapo/q_mean``, ``sapo/v_clipfrac``, ``sapo/q_clipfrac``, ``actor/pg_loss``,
        ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/grad_norm``.
        """
        if turns is not None and turns["turn_mask"].shape != targets["turn_mask"].shape:
            raise ValueError("turns and targets disagree on (bs, K): recompute the targets for this batch")
        beta = self.kl_coef if kl_coef is None else float(kl_coef)
        if beta > 0 and "ref_log_probs" not in targets:
            if self.ref_model is None:
                raise ValueError("kl_coef > 0 needs a reference model (SapoRole(kl_coef>0) or ref_model=...)")
            targets = {**targets, "ref_log_probs": self.reference_log_probs(batch)}
        use_kl = "ref_log_probs" in targets  # measured whenever a reference exists, in the loss when β > 0
        K = int(targets["turn_mask"].shape[1])

        self.engine.train_mode()
        tok_den = self.engine.global_denominator(batch["response_mask"].float().sum())
        turn_den = self.engine.global_denominator(targets["turn_mask"].float().sum())
        inv_tok = 1.0 / tok_den.value if tok_den.value > 0 else 0.0
        inv_turn = 1.0 / turn_den.value if turn_den.value > 0 else 0.0
        # every term is already divided by its own global count: backward divides by 1 only
        one = GlobalDenominator(value=1.0, world_size=self.engine.world_size)

        acc: dict[str, float] = {}
        tensors = {k: v for k, v in targets.items() if torch.is_tensor(v)}
        for rows in self.micro_batching.split(batch):
            mb, tg = _rows(batch, rows), _rows(tensors, rows)
            sums, stats = self._micro_losses(mb, tg, K, clip_eps, clip_v, clip_q, use_kl)
            pol = sums["pg"] * inv_tok
            v_term, q_term = sums["v"] * inv_turn, sums["q"] * inv_turn
            kl, ent = sums["kl"] * inv_tok, sums["entropy"] * inv_tok
            loss = pol + c_v * v_term + c_q * q_term + beta * kl - c_h * ent
            self.engine.backward(loss, one)
            parts = {"loss": loss, "pg": pol, "v": v_term, "q": q_term, "kl": kl, "entropy": ent,
                     **{k: v * (inv_turn if k in ("v_clipfrac", "q_clipfrac") else inv_tok)
                        for k, v in stats.items() if k in ("pg_clipfrac", "ppo_kl", "v_clipfrac", "q_clipfrac")},
                     **{k: v for k, v in stats.items() if k in ("v_sum", "q_sum", "y_sum", "y_sq", "e_sum", "e_sq")}}
            for key, value in parts.items():
                acc[key] = acc.get(key, 0.0) + float(value.detach())
        grad_norm = self.engine.step()

        if self.engine.world_size > 1:  # metrics are rank-local shares / sums: add them up
            keys = sorted(acc)
            vec = torch.tensor([acc[k] for k in keys], dtype=torch.float64, device=self.engine.device)
            dist.all_reduce_sum(vec)
            acc = dict(zip(keys, vec.tolist()))
        n = max(turn_den.value, 1.0)
        y_mean, e_mean = acc["y_sum"] / n, acc["e_sum"] / n
        var_y = acc["y_sq"] / n - y_mean ** 2
        var_e = acc["e_sq"] / n - e_mean ** 2
        explained = 1.0 - var_e / var_y if var_y > 1e-12 else 0.0
        return {
            "sapo/loss": acc["loss"], "sapo/v_loss": acc["v"], "sapo/q_loss": acc["q"], "sapo/kl": acc["kl"],
            "sapo/entropy": acc["entropy"], "sapo/explained_var": explained,
            "sapo/v_mean": acc["v_sum"] / n, "sapo/q_mean": acc["q_sum"] / n,
            "sapo/v_clipfrac": acc["v_clipfrac"], "sapo/q_clipfrac": acc["q_clipfrac"],
            "actor/pg_loss": acc["pg"], "actor/pg_clipfrac": acc["pg_clipfrac"], "actor/ppo_kl": acc["ppo_kl"],
            "actor/grad_norm": grad_norm,
        }

    # -- weights --------------------------------------------------------------------------------
    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full CPU state dict for the rollout engine (the readouts need no extra weights)."""
        return self.engine.full_state_dict()
