"""``model.attn_implementation`` (issue 18): the trained models' attention kernels, refused where they cannot run."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from async_rl.engine.settings import TrainingSettings
from async_rl.models.loading import load_causal_lm
from async_rl.validation import ATTN_IMPLEMENTATIONS, check_attn_implementation


def _flash_attn_installed(monkeypatch, installed: bool) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "flash_attn":
            return object() if installed else None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_sdpa_and_eager_are_accepted_everywhere():
    for name in ("sdpa", "eager"):
        for device, precision in (("cpu", "fp32"), ("cuda", "bf16"), ("cuda:1", "fp32")):
            assert check_attn_implementation(name, device, precision) == name


def test_an_unknown_name_lists_the_choices():
    with pytest.raises(ValueError, match="model.attn_implementation='flash'.*sdpa, flash_attention_2, eager"):
        check_attn_implementation("flash")


def test_flash_attention_without_the_package_names_the_install(monkeypatch):
    _flash_attn_installed(monkeypatch, False)
    with pytest.raises(ValueError, match="pip install flash-attn") as err:
        check_attn_implementation("flash_attention_2", "cuda", "bf16")
    assert "\n" not in str(err.value) and "model.attn_implementation=sdpa" in str(err.value)


def test_flash_attention_needs_a_gpu_and_bf16(monkeypatch):
    _flash_attn_installed(monkeypatch, True)
    with pytest.raises(ValueError, match="CUDA GPUs only"):
        check_attn_implementation("flash_attention_2", "cpu", "bf16")
    with pytest.raises(ValueError, match="trainer.precision=bf16"):
        check_attn_implementation("flash_attention_2", "cuda", "fp32")
    assert check_attn_implementation("flash_attention_2", "cuda:0", "bf16") == "flash_attention_2"


def test_training_settings_validate_and_split_the_keywords(monkeypatch):
    settings = TrainingSettings(attn_implementation="eager").validate()
    assert settings.model_kwargs() == {"attn_implementation": "eager"}
    assert "attn_implementation" not in settings.role_kwargs() and "device" not in settings.role_kwargs()
    _flash_attn_installed(monkeypatch, False)
    with pytest.raises(ValueError, match="flash-attn"):
        TrainingSettings(attn_implementation="flash_attention_2", device="cuda", precision="bf16").validate()


def test_the_loaded_model_uses_the_requested_kernels(tiny_model):
    outputs = {}
    batch = torch.randint(0, 50, (2, 7))
    for name in ("sdpa", "eager"):
        model = load_causal_lm(tiny_model, dtype="float32", attn_implementation=name)
        assert model.config._attn_implementation == name
        with torch.no_grad():
            outputs[name] = model(batch).logits
    # the same weights: the kernels agree to fp32 rounding
    torch.testing.assert_close(outputs["sdpa"], outputs["eager"], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="valid choices"):
        load_causal_lm(tiny_model, attn_implementation="bogus")


def test_the_in_process_roles_load_with_the_setting(tiny_model):
    import async_rl.envs.toy  # noqa: F401
    from async_rl.config import AlgorithmConfig
    from async_rl.assemble import RunSpec, build_learner_and_rollout
    from async_rl.envs.toy import make_toy_tasks

    torch.set_num_threads(1)
    algo = AlgorithmConfig(name="ppo", group_size=1, train_batch_trajectories=4, use_critic=True)
    spec = RunSpec(model_path=str(tiny_model), env_name="toy_keys", tasks=make_toy_tasks("toy_keys", 8, 0),
                   training=TrainingSettings(attn_implementation="eager"))
    learner, _ = build_learner_and_rollout(algo, spec)
    kernels = {module.config._attn_implementation
               for role in (learner.actor, learner.critic)
               for module in role.engine.module.modules() if hasattr(module, "config")
               and hasattr(module.config, "_attn_implementation")}
    assert kernels == {"eager"}


def test_the_cli_refuses_flash_attention_before_building_a_model(monkeypatch, tmp_path):
    from hydra import compose, initialize_config_dir

    from async_rl.train import REPO_CONF, check_run_config
    from async_rl.validation import ConfigError

    _flash_attn_installed(monkeypatch, False)
    with initialize_config_dir(config_dir=REPO_CONF, version_base=None):
        cfg = compose(config_name="demo", overrides=["model.attn_implementation=flash_attention_2",
                                                       f"trainer.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="flash-attn"):
        check_run_config(cfg)
    assert not any(tmp_path.iterdir())  # nothing built
    assert "flash_attention_2" in ATTN_IMPLEMENTATIONS
