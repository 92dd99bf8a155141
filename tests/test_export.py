"""Trained models out (async_rl.models.export): the policy as a Hugging Face model directory that
``async_rl.eval`` (``make eval``) loads with no further arguments; SAPO's reserved ids travel with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from async_rl.models.export import (
    EXPORT_KEY,
    banned_token_ids_of,
    export_policy,
    export_run_policy,
    exported_model_info,
    read_last_run,
    resolve_model_dir,
    write_last_run,
)
from async_rl.models.loading import load_causal_lm, load_tokenizer


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    from async_rl.models.tiny import make_tiny_model

    torch.set_num_threads(1)
    return make_tiny_model(tmp_path_factory.mktemp("base"), hidden_size=32, num_layers=1)


def _shifted_weights(model_dir, delta=0.01):
    """The base weights moved by ``delta``: stands for a trained policy that differs from its start."""
    return {k: v.clone() + delta for k, v in load_causal_lm(model_dir).state_dict().items()}


def test_export_round_trip_with_config_tokenizer_and_card(base_model, tmp_path):
    weights = _shifted_weights(base_model)
    out = export_policy(weights, base_model, tmp_path / "run" / "model",
                        {"algorithm": "grpo", "env": "toy_keys", "step": 7, "run_name": "r"})
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "README.md", "tokenizer.json"} <= names
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".")]  # no partial dirs left
    loaded = load_causal_lm(out).state_dict()
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)  # float32 base: bit for bit
    info = exported_model_info(out)
    assert info["algorithm"] == "grpo" and info["step"] == 7 and info["base_model"] == str(base_model)
    assert "sapo_reserved_token_ids" not in info and banned_token_ids_of(out) == ()
    assert load_tokenizer(out).get_vocab() == load_tokenizer(base_model).get_vocab()
    base_generation = json.loads((Path(base_model) / "generation_config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == base_generation["eos_token_id"] and "suppress_tokens" not in generation
    card = (out / "README.md").read_text()
    assert "grpo" in card and "make eval MODEL=" in card and "SAPO" not in card
    # exporting again replaces the directory as a whole
    again = _shifted_weights(base_model, 0.02)
    export_policy(again, base_model, out, {"algorithm": "grpo", "step": 8})
    assert exported_model_info(out)["step"] == 8
    assert torch.equal(load_causal_lm(out).state_dict()["lm_head.weight"], again["lm_head.weight"])


def test_export_names_missing_and_unexpected_keys(base_model, tmp_path):
    weights = _shifted_weights(base_model)
    weights.pop("lm_head.weight")
    weights["module.extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\].*unexpected \['module.extra'\]"):
        export_policy(weights, base_model, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_tied_embeddings_are_stored_once_and_tied_on_load(base_model, tmp_path):
    import shutil

    tied_base = tmp_path / "tied"
    shutil.copytree(base_model, tied_base)
    config = json.loads((tied_base / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (tied_base / "config.json").write_text(json.dumps(config))
    weights = _shifted_weights(base_model)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()  # a tied policy: equal rows
    out = export_policy(weights, tied_base, tmp_path / "model")
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        assert "lm_head.weight" not in set(handle.keys())
    model = load_causal_lm(out)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.model.embed_tokens.weight, weights["model.embed_tokens.weight"])


def test_export_in_the_base_dtype_unless_asked(base_model, tmp_path):
    weights = _shifted_weights(base_model)
    half = export_policy(weights, base_model, tmp_path / "bf16", dtype="bfloat16")
    assert load_causal_lm(half).dtype == torch.bfloat16
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="export dtype must be one of"):
        export_policy(weights, base_model, tmp_path / "x", dtype="int8")


def test_sapo_export_keeps_the_reserved_ids_and_eval_bans_them(base_model, tmp_path, monkeypatch):
    from async_rl.eval import main
    from async_rl.rollout.hf_engine import HFRolloutEngine
    from async_rl.workers.sapo import resolve_reserved_ids

    reserved = resolve_reserved_ids(load_tokenizer(base_model))  # the tiny tokenizer's value tokens: 3, 4
    assert reserved == (3, 4)
    out = export_policy(_shifted_weights(base_model), base_model, tmp_path / "sapo" / "model",
                        {"algorithm": "sapo", "sapo_tau_v": 5.0, "sapo_r_max": 1.0}, reserved_ids=reserved)
    info = exported_model_info(out)
    assert info["sapo_reserved_token_ids"] == [3, 4]
    assert info["sapo_reserved_tokens"] == ["<|value_plus|>", "<|value_minus|>"]
    assert json.loads((out / "generation_config.json").read_text())["suppress_tokens"] == [3, 4]
    assert "w+ = 3" in (out / "README.md").read_text() and "tau_v = 5.0" in (out / "README.md").read_text()
    assert banned_token_ids_of(out) == (3, 4)

    seen: list[tuple[int, ...]] = []
    original = HFRolloutEngine.generate

    def recording(self, requests):
        seen.extend(tuple(r.sampling.banned_token_ids) for r in requests)
        return original(self, requests)

    monkeypatch.setattr(HFRolloutEngine, "generate", recording)
    report = main([f"model_dir={out}", "env=toy_echo", "n_samples=2", "ks=[1]", "limit=2", "max_new_tokens=4",
                   f"output_dir={tmp_path / 'eval'}", "plot=false", f"runs_dir={tmp_path / 'none'}"])
    assert seen and set(seen) == {(3, 4)}
    samples = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and report["sets"]["toy_echo"]["num_problems"] == 2
    with pytest.raises(ValueError, match="two different ids"):
        export_policy(_shifted_weights(base_model), base_model, tmp_path / "bad", reserved_ids=[3, 3])


def test_run_export_from_an_actor_role_and_the_last_run_pointer(base_model, tmp_path):
    from async_rl.engine.base import OptimizerConfig
    from async_rl.workers.roles import ActorRole

    actor = ActorRole(load_causal_lm(base_model), OptimizerConfig(lr=1e-3))
    with torch.no_grad():  # stands in for training: the exported weights must be the actor's, not the base's
        for param in actor.engine.module.parameters():
            param.add_(0.05)
    root = tmp_path / "outputs"
    run_dir = root / "toy-run"
    run_dir.mkdir(parents=True)
    model_dir = export_run_policy(actor, base_model, run_dir, root, {"algorithm": "grpo", "env": "toy_keys", "step": 3})
    assert model_dir == run_dir / "model"
    expected = actor.export_weights()
    loaded = load_causal_lm(model_dir).state_dict()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    assert not torch.equal(loaded["lm_head.weight"], load_causal_lm(base_model).state_dict()["lm_head.weight"])
    record = read_last_run(root)
    assert record["run_dir"] == str(run_dir) and record["model_dir"] == str(model_dir) and record["step"] == 3
    assert resolve_model_dir(run_dir) == model_dir and resolve_model_dir(model_dir) == model_dir


def test_last_run_pointer_errors(tmp_path):
    assert read_last_run(tmp_path) is None
    (tmp_path / "last_run.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON.*MODEL=<dir>"):
        read_last_run(tmp_path)
    (tmp_path / "last_run.json").write_text(json.dumps({"run_dir": "x"}))
    with pytest.raises(ValueError, match="lacks run_dir / model_dir"):
        read_last_run(tmp_path)
    write_last_run(tmp_path, tmp_path / "a", tmp_path / "a" / "model", {"env": "math"})
    assert read_last_run(tmp_path)["env"] == "math"
    assert EXPORT_KEY == "async_rl"


@pytest.mark.slow
def test_train_exports_and_eval_without_arguments_evaluates_it(tmp_path, monkeypatch, capsys):
    """The new user's path: train -> `make eval` (no MODEL, no ENV) -> `make plots` (no RUN)."""
    from hydra import compose, initialize_config_dir

    from async_rl.eval import main as eval_main
    from async_rl.plots import load_pass_at_k
    from async_rl.plots import main as plots_main
    from async_rl.train import REPO_CONF, run

    monkeypatch.chdir(tmp_path)  # outputs/ relative to the working directory, as with make
    with initialize_config_dir(config_dir=REPO_CONF, version_base=None):
        cfg = compose(config_name="config", overrides=[
            "algorithm=grpo", "algorithm.train_batch_trajectories=8", "algorithm.group_size=4", "env=toy_echo",
            "model.sft.enabled=false", "model.hidden_size=32", "model.num_layers=1", "model.dir=models/tiny",
            "trainer.run_name=t", "trainer.driver.total_steps=2", "trainer.wandb=false", "env.max_new_tokens=5"])
    summary = run(cfg)
    run_dir = Path("outputs") / "t"
    assert summary["model_dir"] == str(run_dir / "model")
    assert exported_model_info(run_dir / "model")["env"] == "toy_echo"
    assert json.loads((run_dir / "summary.json").read_text())["model_dir"] == str(run_dir / "model")
    capsys.readouterr()

    # `make eval` with MODEL unset passes `model_dir=`: the same as leaving it out
    report = eval_main(["model_dir=", "n_samples=2", "ks=[1,2]", "limit=2"])
    err = capsys.readouterr().err
    assert f"model: {run_dir / 'model'}, the latest exported model" in err
    assert "env: toy_echo (the env the model was trained on" in err
    assert "env config: the one run outputs/t trained with" in err
    assert report["env"] == "toy_echo" and report["max_new_tokens"] == 5  # the run's env settings
    assert (run_dir / "eval" / "pass_at_k.json").is_file() and (run_dir / "eval" / "eval.png").is_file()
    assert load_pass_at_k(run_dir) is not None  # training.png shows the evaluation of the run's model

    plots_main([])  # `make plots` with RUN unset
    assert f"plotting the last run, {Path.cwd() / run_dir}" in capsys.readouterr().out
