"""Build a tiny, randomly initialised Qwen2 model + tokenizer directory for CPU tests.

The directory written by :func:`make_tiny_model` looks exactly like a real Hugging Face
checkpoint (``config.json``, ``model.safetensors``, ``generation_config.json``,
``tokenizer.json``, ``tokenizer_config.json`` with a chat template), so every code path
that loads ``Qwen2.5-1.5B-Instruct`` from disk can be exercised with it in seconds.

The tokenizer is a byte-level BPE trained on a small built-in corpus. Byte-level means
every byte has a token, so *any* text (ASCII or not) encodes and decodes losslessly;
environment observations therefore round-trip exactly through ``encode``/``decode``.

CLI::

    python -m async_rl.models.tiny --out /tmp/tiny-qwen2 [--hidden-size 64 --num-layers 2 ...]
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from async_rl.validation import parse_settings, setting

# Special tokens, in the order they get ids 0, 1, 2, ... in the tiny vocabulary.
ENDOFTEXT_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Rarely used reserved tokens: a value head-free algorithm can read a scalar value from
# the two logits of these ids (e.g. V = sigmoid(logit_plus - logit_minus)).
VALUE_PLUS_TOKEN = "<|value_plus|>"
VALUE_MINUS_TOKEN = "<|value_minus|>"
SPECIAL_TOKENS: tuple[str, ...] = (
    ENDOFTEXT_TOKEN,
    IM_START_TOKEN,
    IM_END_TOKEN,
    VALUE_PLUS_TOKEN,
    VALUE_MINUS_TOKEN,
)
RESERVED_VALUE_TOKENS: tuple[str, str] = (VALUE_PLUS_TOKEN, VALUE_MINUS_TOKEN)

# Qwen2.5-style chat template (without Qwen's default system prompt and tool handling):
#   <|im_start|>{role}\n{content}<|im_end|>\n ... [<|im_start|>assistant\n]
QWEN_STYLE_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

DEFAULT_VOCAB_SIZE = 512
_NUM_BYTE_TOKENS = 256

# Words that show up in math / agentic RL prompts; the BPE merges learned from them make
# typical test strings a few tokens long instead of one token per byte.
_CORPUS_WORDS: tuple[str, ...] = (
    "action", "think", "search", "click", "boxed", "answer", "observation", "reward",
    "user", "assistant", "system", "tool", "call", "result", "step", "done", "true",
    "false", "the", "a", "an", "is", "of", "to", "and", "in", "for", "on", "with", "what",
    "find", "value", "number", "sum", "product", "total", "price", "buy", "item", "page",
    "next", "back", "open", "close", "go", "north", "south", "east", "west", "take", "put",
    "look", "inventory", "room", "door", "key", "box", "question", "solve", "equation",
    "therefore", "so", "let", "be", "we", "have", "get", "final", "is", "not", "yes", "no",
    "Hello", "world", "The", "Answer", "Search", "Click", "Action", "Think", "Step",
)
_CORPUS_TEMPLATES: tuple[str, ...] = (
    "<think> {w0} {w1} {w2} </think>",
    "action: {w0}[{w1} {w2}]",
    "search[{w0} {w1}]",
    "click[{w0}]",
    "The answer is \\boxed{{{n0}}}.",
    "{n0} + {n1} = {n2}",
    "{n0} * {n1} = {n2}",
    "{w0} {w1} {w2} {w3}.",
    "Observation: {w0} {w1}, {w2}!",
    "Q: What is {n0} - {n1}? A: {n2}",
    '{{"action": "{w0}", "arg": "{w1}"}}',
    "Step {n0}: {w0} the {w1}.",
)


def build_corpus(num_lines: int = 4000, seed: int = 0) -> list[str]:
    """Return a deterministic synthetic corpus of ``num_lines`` short lines.

    Mixes digits, letters, punctuation and agentic/math keywords so the trained BPE has
    useful merges; exact content does not matter for correctness because byte-level BPE is
    lossless on any input.
    """
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        template = rng.choice(_CORPUS_TEMPLATES)
        words = {f"w{i}": rng.choice(_CORPUS_WORDS) for i in range(4)}
        numbers = {f"n{i}": str(rng.randint(0, 999)) for i in range(3)}
        lines.append(template.format(**words, **numbers))
    return lines


# Qwen2's pre-tokenisation regex (from its tokenizer.json): contractions, letter runs,
# single digits, punctuation runs, newlines, whitespace. The tiny tokenizer is trained with
# the same pipeline (NFC -> regex split -> byte-level) because transformers' Qwen2Tokenizer
# rebuilds exactly this pipeline when it loads a qwen2 checkpoint; training with anything
# else would make the saved merges disagree with how the loaded tokenizer splits text.
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _train_byte_level_bpe(vocab_size: int, seed: int):
    """Train a Qwen2-style byte-level BPE on :func:`build_corpus`; returns (vocab, merges)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            # add_prefix_space=False keeps decode(encode(x)) == x (no invented spaces).
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte is in the alphabet even if the corpus never shows it -> lossless.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(build_corpus(seed=seed), trainer=trainer)
    model_json = json.loads(bpe.to_str())["model"]
    # Serialised merges are ["a", "b"] pairs (or "a b" strings in older tokenizers).
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model_json["merges"]]
    return dict(model_json["vocab"]), merges


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0):
    """Train a byte-level BPE tokenizer and wrap it as a transformers fast tokenizer.

    Returns a ``Qwen2Tokenizer`` (transformers' tokenizers-backed fast tokenizer, the class
    real Qwen2.5 checkpoints load as) with exactly ``vocab_size`` entries (ids
    ``0 .. vocab_size-1``): the special tokens (:data:`SPECIAL_TOKENS`, ids 0..4), all 256
    byte tokens, learned merges and, if the corpus runs out of merges, padding tokens
    ``<|reserved_{i}|>`` so the model's embedding matrix and the tokenizer always agree.

    Lossless on any NFC-normalised text, which includes all ASCII text.
    """
    from transformers import Qwen2Tokenizer

    min_vocab = len(SPECIAL_TOKENS) + _NUM_BYTE_TOKENS + 1
    if vocab_size < min_vocab:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE with "
            f"{len(SPECIAL_TOKENS)} special tokens: use vocab_size >= {min_vocab}."
        )
    vocab, merges = _train_byte_level_bpe(vocab_size, seed)
    padding_tokens = [f"<|reserved_{i}|>" for i in range(vocab_size - len(vocab))]
    for token in padding_tokens:
        vocab[token] = len(vocab)

    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token=ENDOFTEXT_TOKEN,
        pad_token=ENDOFTEXT_TOKEN,
        unk_token=None,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN, *RESERVED_VALUE_TOKENS, *padding_tokens],
        # Never rewrite spaces around punctuation on decode: it would break round-trips.
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
        chat_template=QWEN_STYLE_CHAT_TEMPLATE,
    )
    if len(tokenizer) != vocab_size:
        raise RuntimeError(f"tiny tokenizer has {len(tokenizer)} tokens, expected {vocab_size}")
    return tokenizer


def make_tiny_model(
    out_dir: str | os.PathLike,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    seed: int = 0,
) -> Path:
    """Write a randomly initialised Qwen2 causal LM and its tokenizer to ``out_dir``.

    Args:
        out_dir: directory to create (parents too); existing files are overwritten.
        vocab_size: tokenizer size == model embedding rows (ids ``0 .. vocab_size-1``).
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
        max_position_embeddings: the ``Qwen2Config`` fields of the same meaning.
            ``hidden_size`` must be divisible by ``num_heads`` and ``num_heads`` by
            ``num_kv_heads`` (grouped-query attention, as in Qwen2.5).
        seed: seeds both the BPE corpus and the weight initialisation, so the same
            arguments always produce the same weights.

    Returns:
        ``Path(out_dir)``, loadable with :func:`async_rl.models.loading.load_causal_lm`
        and :func:`async_rl.models.loading.load_tokenizer` (or ``Auto*.from_pretrained``).
    """
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if hidden_size % num_heads != 0:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be divisible by num_kv_heads={num_kv_heads}")

    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(vocab_size=vocab_size, seed=seed)
    eos_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT_TOKEN)
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END_TOKEN)

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="float32",
    )
    # Seed the global RNG only for the duration of the init, then restore it, so calling
    # this from a test does not change the randomness of the rest of the test session.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        # Like Qwen2.5-Instruct: a chat turn ends with <|im_end|>, a document with <|endoftext|>.
        eos_token_id=[im_end_id, eos_id],
        pad_token_id=eos_id,
        bos_token_id=eos_id,
    )
    model.save_pretrained(out_path)
    tokenizer.save_pretrained(out_path)
    return out_path


@dataclass
class TinyModelOptions:
    """``python -m async_rl.models.tiny`` options: the :func:`make_tiny_model` arguments, each a setting."""

    out: str = setting(meaning="output directory", non_empty=True)
    vocab_size: int = setting(DEFAULT_VOCAB_SIZE, "byte-level BPE vocabulary size (special tokens included)",
                              range=f">= {len(SPECIAL_TOKENS) + _NUM_BYTE_TOKENS + 1}")
    hidden_size: int = setting(64, "model width (a multiple of num_heads, even head size)", range=">= 8")
    num_layers: int = setting(2, "decoder layers", range=">= 1")
    num_heads: int = setting(4, "attention heads", range=">= 1")
    num_kv_heads: int = setting(2, "key/value heads (divides num_heads)", range=">= 1")
    intermediate_size: int = setting(128, "MLP width", range=">= 1")
    max_position_embeddings: int = setting(1024, "context length in tokens", range=">= 2")
    seed: int = setting(0, "seed of the random weights", range=">= 0")


def _parse_args(argv: list[str] | None = None) -> TinyModelOptions:
    return parse_settings(TinyModelOptions, argv, "Write a tiny random Qwen2 model + byte-level BPE tokenizer "
                          "directory.", prog="python -m async_rl.models.tiny")


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    out = make_tiny_model(
        args.out,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_position_embeddings,
        seed=args.seed,
    )
    print(json.dumps({"out": str(out), "files": sorted(p.name for p in out.iterdir())}))


if __name__ == "__main__":
    main()
