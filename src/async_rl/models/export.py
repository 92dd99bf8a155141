"""Trained models out: the policy as a Hugging Face model directory, and where the last one is.

At the end of a run ``async_rl.train`` calls :func:`export_run_policy`, which writes
``outputs/<run>/model/`` (``config.json`` with an ``"async_rl"`` field, ``model*.safetensors`` sharded at
5 GB with ``model.safetensors.index.json``, ``generation_config.json``, the tokenizer, a ``README.md`` model
card) and points ``outputs/last_run.json`` at it, so ``make eval`` / ``make plots`` without arguments find
the latest model and its run (:func:`read_last_run`). For SAPO (spec §5) the two reserved value-readout ids
stay reserved: recorded in the config, suppressed in the generation config, read back by
:func:`banned_token_ids_of`.

Details: docs/evaluation.md (Exported models and ``make eval`` without arguments); docs/sapo.md (Reserved ids).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch

__all__ = [
    "EXPORT_KEY",
    "LAST_RUN_FILE",
    "banned_token_ids_of",
    "export_policy",
    "export_run_policy",
    "exported_model_info",
    "read_last_run",
    "resolve_model_dir",
    "write_last_run",
]

#: config.json field that holds what async_rl knows about an exported model
EXPORT_KEY = "async_rl"
#: pointer file under the output root (``outputs/last_run.json``)
LAST_RUN_FILE = "last_run.json"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype_of(config, dtype: Optional[str]) -> Optional[torch.dtype]:
    """The dtype to save floating weights in: ``dtype`` by name, else the base config's (``None``: as is)."""
    name = dtype
    if name is None:
        name = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if name is None:
        return None
    name = str(name).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"export dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[name]


def _expected_keys(config) -> tuple[set[str], set[str]]:
    """(every state-dict key of the architecture, the keys tied to another one), from a meta-device model."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    keys = set(model.state_dict())
    tied: set[str] = set()
    if getattr(config, "tie_word_embeddings", False):
        out = model.get_output_embeddings()
        for name, param in model.named_parameters(remove_duplicate=False):
            if out is not None and param is out.weight and name != "model.embed_tokens.weight":
                tied.add(name)
    return keys, tied


@contextlib.contextmanager
def _quiet_hub():
    """huggingface_hub's shard progress bar and "saved to <tmp dir>" log line would name the temporary
    folder; the caller prints where the model went."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    hub_logger = logging.getLogger("huggingface_hub")
    level, bars_were_off = hub_logger.level, are_progress_bars_disabled()
    hub_logger.setLevel(logging.WARNING)
    disable_progress_bars()
    try:
        yield
    finally:
        hub_logger.setLevel(level)
        if not bars_were_off:
            enable_progress_bars()


def _model_card(info: Mapping[str, Any]) -> str:
    lines = [
        "---",
        "library_name: transformers",
        "tags: [async_rl, " + str(info.get("algorithm", "unknown")) + "]",
        "---",
        "",
        f"# {info.get('run_name') or 'async_rl policy'}",
        "",
        f"Policy trained by async_rl with **{info.get('algorithm')}** on env `{info.get('env')}` for "
        f"{info.get('step')} optimizer steps, starting from `{info.get('base_model')}`.",
        f"Run directory: `{info.get('run_dir')}` (metrics.jsonl, summary.json, training.png).",
        "",
        "Evaluate (from the repository root):",
        "",
        "```bash",
        f"make eval MODEL={info.get('model_dir')}",
        "```",
        "",
    ]
    reserved = info.get("sapo_reserved_token_ids")
    if reserved:
        lines += [
            "## SAPO value readout",
            "",
            f"Two vocabulary entries are reserved for the value readout: w+ = {reserved[0]} "
            f"(`{info['sapo_reserved_tokens'][0]}`) and w- = {reserved[1]} (`{info['sapo_reserved_tokens'][1]}`).",
            "The policy never emits them: ban them when sampling (`generation_config.json` suppresses them; "
            "`async_rl.eval` bans them from `config.json`'s `async_rl.sapo_reserved_token_ids`).",
            f"V(state) = R_max * clip((z+ - z-) / tau_v, -1, 1) with tau_v = {info.get('sapo_tau_v')}, "
            f"R_max = {info.get('sapo_r_max')}, read from the logits at the last state token; Q(state, action) "
            "the same at the last action token (docs/sapo.md).",
            "",
        ]
    return "\n".join(lines)


def export_policy(
    weights: Mapping[str, torch.Tensor],
    base_model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    info: Optional[Mapping[str, Any]] = None,
    *,
    reserved_ids: Optional[Sequence[int]] = None,
    dtype: Optional[str] = None,
    max_shard_size: str | int = "5GB",
) -> Path:
    """Write ``weights`` as a Hugging Face model directory at ``out_dir`` (replaced atomically).

    Args:
        weights: the policy's full state dict (``ActorRole.export_weights()``, ``SapoRole.export_weights()``
            or the Ray actor's rank-0 dict), keys named as in the base architecture.
        base_model_dir: the checkpoint training started from: config, tokenizer and generation config come
            from there.
        out_dir: the directory to write; an existing one is replaced only once the new one is complete.
        info: provenance stored under ``config.json``'s ``"async_rl"`` field and in the model card
            (``algorithm``, ``env``, ``step``, ``run_dir``, ...).
        reserved_ids: SAPO's ``(w+, w-)``: recorded in the config, suppressed in the generation config.
        dtype: ``float32`` / ``bfloat16`` / ``float16``; ``None`` = the base config's dtype (training may
            keep fp32 master weights; the export matches what was loaded).
        max_shard_size: safetensors shard size (``save_torch_state_dict``'s).

    Raises:
        ValueError: a key of the architecture is missing from ``weights`` or ``weights`` holds keys the
            architecture does not have (both listed), or ``reserved_ids`` is not two distinct ids.
    """
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoConfig, GenerationConfig

    from async_rl.models.loading import load_tokenizer

    base = Path(base_model_dir)
    out = Path(out_dir)
    config = AutoConfig.from_pretrained(str(base), local_files_only=True)
    expected, tied = _expected_keys(config)
    given = set(weights)
    missing = sorted(expected - tied - given)
    unexpected = sorted(given - expected)
    if missing or unexpected:
        raise ValueError(f"the weights do not fit {base}'s architecture: missing {missing[:5]} "
                         f"({len(missing)} in all), unexpected {unexpected[:5]} ({len(unexpected)} in all)")
    target = _dtype_of(config, dtype)
    state: dict[str, torch.Tensor] = {}
    for key, tensor in weights.items():
        if key in tied:
            continue  # stored once, as the input embedding (tie_word_embeddings)
        tensor = tensor.detach().to("cpu")
        if target is not None and tensor.is_floating_point():
            tensor = tensor.to(target)
        state[key] = tensor.contiguous()

    meta = dict(info or {})
    meta["base_model"] = str(meta.get("base_model") or base)
    meta["exported_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    if reserved_ids is not None:
        reserved_ids = [int(i) for i in reserved_ids]
        if len(reserved_ids) != 2 or reserved_ids[0] == reserved_ids[1]:
            raise ValueError(f"reserved_ids must be two different ids (w+, w-), got {reserved_ids}")
        meta["sapo_reserved_token_ids"] = reserved_ids
    meta.setdefault("model_dir", str(out))

    tokenizer = load_tokenizer(base)
    if reserved_ids is not None:
        meta["sapo_reserved_tokens"] = tokenizer.convert_ids_to_tokens(reserved_ids)
    try:
        generation = GenerationConfig.from_pretrained(str(base), local_files_only=True)
    except OSError:  # the base checkpoint has no generation_config.json
        generation = GenerationConfig.from_model_config(config)
    if reserved_ids is not None:
        generation.suppress_tokens = sorted(set(list(generation.suppress_tokens or []) + reserved_ids))
    setattr(config, EXPORT_KEY, meta)
    if target is not None:
        config.dtype = target

    # written next to the target, then swapped in: a reader never sees a half-written model
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with _quiet_hub():
            save_torch_state_dict(state, tmp, max_shard_size=max_shard_size, metadata={"format": "pt"})
        config.save_pretrained(tmp)
        generation.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "README.md").write_text(_model_card(meta) + "\n")
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export_run_policy(actor: Any, base_model_dir: str | os.PathLike, run_dir: str | os.PathLike,
                      output_root: str | os.PathLike, info: Mapping[str, Any],
                      reserved_ids: Optional[Sequence[int]] = None) -> Path:
    """The end-of-run export: ``actor.export_weights()`` -> ``<run_dir>/model``, then
    ``<output_root>/last_run.json`` points at it. Works for the local roles and the Ray actor (its
    ``export_weights`` gathers the full state dict on rank 0 and returns it to the driver)."""
    weights = actor.export_weights()
    if not weights:
        raise RuntimeError(f"{type(actor).__name__}.export_weights() returned no weights; cannot export the policy")
    run_dir = Path(run_dir)
    model_dir = run_dir / "model"
    full_info = {**info, "run_dir": str(run_dir), "model_dir": str(model_dir)}
    export_policy(weights, base_model_dir, model_dir, full_info, reserved_ids=reserved_ids)
    write_last_run(output_root, run_dir, model_dir, full_info)
    return model_dir


# --------------------------------------------------------------------------------------------------
# Finding exported models
# --------------------------------------------------------------------------------------------------


def write_last_run(output_root: str | os.PathLike, run_dir: str | os.PathLike, model_dir: str | os.PathLike,
                   info: Optional[Mapping[str, Any]] = None) -> Path:
    """``<output_root>/last_run.json`` = ``{"run_dir", "model_dir", ...info}`` (written atomically). The two
    paths are stored absolute, so the pointer works from any working directory."""
    root = Path(output_root)
    root.mkdir(parents=True, exist_ok=True)
    record = {**dict(info or {}), "run_dir": str(Path(run_dir).resolve()), "model_dir": str(Path(model_dir).resolve())}
    path = root / LAST_RUN_FILE
    tmp = root / f".{LAST_RUN_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def read_last_run(output_root: str | os.PathLike = "outputs") -> Optional[dict[str, Any]]:
    """The record :func:`write_last_run` wrote, or ``None`` when no run has exported a model yet."""
    path = Path(output_root) / LAST_RUN_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); delete it and train again, or pass MODEL=<dir>") from exc
    if not isinstance(record, dict) or "run_dir" not in record or "model_dir" not in record:
        raise ValueError(f"{path} lacks run_dir / model_dir; delete it and train again, or pass MODEL=<dir>")
    return record


def resolve_model_dir(path: str | os.PathLike) -> Path:
    """A model directory, also accepting a run directory (``outputs/<run>`` -> ``outputs/<run>/model``)."""
    path = Path(path).expanduser()
    # a run directory holds its own config.json (the run's config) next to metrics.jsonl
    is_run = (path / "metrics.jsonl").is_file() or not (path / "config.json").is_file()
    if is_run and (path / "model" / "config.json").is_file():
        return path / "model"
    return path


def exported_model_info(model_dir: str | os.PathLike) -> Optional[dict[str, Any]]:
    """``config.json``'s ``"async_rl"`` field (None for a model async_rl did not export)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text()).get(EXPORT_KEY)
    except (ValueError, AttributeError):
        return None
    return dict(value) if isinstance(value, dict) else None


def banned_token_ids_of(model_dir: str | os.PathLike) -> tuple[int, ...]:
    """Token ids a sampler must ban for this model: SAPO's two reserved value ids, else none."""
    info = exported_model_info(model_dir) or {}
    return tuple(int(i) for i in info.get("sapo_reserved_token_ids") or ())
