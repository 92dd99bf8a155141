"""A cached SFT warm start (model.sft.dir) is reused only for what it was made from: the base model, the SFT
settings, the env and the env settings its demonstrations depend on; the run's seed is not among them (seeds share
one warm start, as the real-model recipe's runs do)."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from async_rl.train import WARM_START_RECORD, check_warm_start, warm_start_record
from async_rl.validation import ConfigError

ENV = {"name": "reasoning_gym", "dataset": "basic_arithmetic", "dataset_config": {"max_digits": 2}, "data_seed": 0,
       "num_train": 20, "num_eval": 5, "answer_format": "answer_tag", "prompt_template": None, "max_new_tokens": 24}
MODEL = {"sft": {"enabled": True, "steps": 80, "noise": 0.0, "lr": 1e-5, "dir": None}}


def _record(base, env=None, model=None):
    return warm_start_record(base, OmegaConf.create(model or MODEL), "reasoning_gym", OmegaConf.create(env or ENV))


def _made(tmp_path, record, seed=0):
    warm = tmp_path / "warm"
    warm.mkdir(exist_ok=True)
    (warm / WARM_START_RECORD).write_text(json.dumps({**record, "seed": seed}))
    return warm


def test_the_same_task_reuses_it_whatever_the_seed_and_the_rollout_lengths(tmp_path):
    warm = _made(tmp_path, _record(tmp_path / "base"), seed=3)
    check_warm_start(warm, _record(tmp_path / "base", env={**ENV, "max_new_tokens": 64}))


@pytest.mark.parametrize("change, named", [
    ({"env": {**ENV, "answer_format": "hashes"}}, "env settings"),
    ({"env": {**ENV, "dataset_config": {"max_digits": 1}}}, "env settings"),
    ({"env": {**ENV, "dataset": "gsm_symbolic", "dataset_config": {}}}, "env settings"),
    ({"model": {"sft": {**MODEL["sft"], "steps": 120}}}, "sft"),
])
def test_another_task_or_sft_setting_is_refused_naming_the_fix(tmp_path, change, named):
    warm = _made(tmp_path, _record(tmp_path / "base"))
    with pytest.raises(ConfigError) as info:
        check_warm_start(warm, _record(tmp_path / "base", **change))
    message = str(info.value)
    assert "\n" not in message and f"for another {named}" in message and "delete that folder" in message


def test_another_base_model_is_refused_and_a_moved_one_is_not(tmp_path):
    for name, width in (("base", 64), ("other-base", 128), ("moved/base", 64)):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "config.json").write_text(json.dumps({"hidden_size": width}))
    warm = _made(tmp_path, _record(tmp_path / "base"))
    with pytest.raises(ConfigError, match="another base model"):
        check_warm_start(warm, _record(tmp_path / "other-base"))
    check_warm_start(warm, _record(tmp_path / "moved" / "base"))  # the same model by content, elsewhere


def test_a_folder_from_before_the_records_is_used_with_a_note(tmp_path, capsys):
    warm = tmp_path / "warm"
    warm.mkdir()
    check_warm_start(warm, _record(tmp_path / "base"))
    assert f"{warm} has no {WARM_START_RECORD}" in capsys.readouterr().out
