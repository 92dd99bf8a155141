"""One settings scheme (issue 35, item 4): every config group and every command-line tool's options is a dataclass
whose fields carry type, default, range and meaning; validation is derived from them in one place
(async_rl.validation); the Hydra YAML mirrors them; no settings object is filled from another field by field."""

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
from omegaconf import OmegaConf

from async_rl.config import AlgorithmConfig
from async_rl.driver.settings import DriverConfig
from async_rl.engine.settings import TrainingSettings
from async_rl.envs.settings import ENV_SETTINGS, EnvSettings, SandboxSettings, check_env
from async_rl.eval import EvalConfig
from async_rl.models.packaged import MaterializeOptions
from async_rl.models.sft import SFTOptions
from async_rl.models.tiny import TinyModelOptions
from async_rl.plots import PlotOptions
from async_rl.rollout.settings import ReplicaSettings
from async_rl.settings import ModelSettings, SFTSettings, TrainerSettings
from async_rl.validation import (ConfigError, check_settings, field_default, fill_from, parse_settings, setting,
                                 settings_fields)

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"

SETTINGS_CLASSES = [AlgorithmConfig, DriverConfig, ReplicaSettings, TrainingSettings, TrainerSettings, ModelSettings, SFTSettings,
                    EnvSettings, SandboxSettings, *ENV_SETTINGS.values(), EvalConfig, SFTOptions, TinyModelOptions,
                    PlotOptions, MaterializeOptions]


@pytest.mark.parametrize("cls", SETTINGS_CLASSES, ids=lambda c: c.__name__)
def test_every_field_has_a_meaning_a_type_rule_and_numbers_a_range(cls):
    for name, f, rule in settings_fields(cls):
        assert f.metadata.get("meaning", "").strip(), f"{cls.__name__}.{name} has no meaning: use setting(..., meaning)"
        assert rule is not None, f"{cls.__name__}.{name}: its annotation gives no type rule"
        if rule.kind in ("int", "float"):
            assert rule.range, f"{cls.__name__}.{name} is a number without a range: setting(..., range='>= 0')"
        default = field_default(f)
        if default is not dataclasses.MISSING and rule.choices and default is not None:
            assert default in rule.choices, f"{cls.__name__}.{name}: default {default!r} is not one of its choices"


@pytest.mark.parametrize("cls", SETTINGS_CLASSES, ids=lambda c: c.__name__)
def test_the_defaults_pass_their_own_checks(cls):
    required = {f.name: "x" for f in dataclasses.fields(cls) if field_default(f) is dataclasses.MISSING}
    if cls is MaterializeOptions:
        required["name"] = "smollm2"
    if issubclass(cls, EnvSettings) and cls is EnvSettings:
        required["name"] = "my_env"
    check_settings(cls(**required), "x")


def _yaml(path: Path) -> dict:
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


def _defaults(cls) -> dict:
    return {f.name: (dataclasses.asdict(d) if dataclasses.is_dataclass(d := field_default(f)) else d)
            for f in dataclasses.fields(cls)}


def _same_values(yaml: dict, defaults: dict, where: str, skip=()) -> None:
    for key, value in yaml.items():
        if key in skip or (isinstance(value, str) and "${" in value and value != defaults[key]):
            continue  # an interpolation Hydra resolves (${oc.env:ALFWORLD_DATA,...}) is checked after composing
        want = defaults[key]
        if isinstance(want, tuple):
            want = list(want)
        assert value == want, f"{where}: {key} is {value!r} in the YAML, {want!r} in the settings class"


def test_trainer_and_rollout_yaml_are_their_settings_field_for_field_and_value_for_value():
    trainer = _yaml(CONF / "trainer" / "default.yaml")
    assert set(trainer) == {f.name for f in dataclasses.fields(TrainerSettings)}
    _same_values(trainer, _defaults(TrainerSettings), "trainer/default.yaml")
    assert set(trainer["driver"]) == {f.name for f in dataclasses.fields(DriverConfig)}
    _same_values(trainer["driver"], _defaults(DriverConfig), "trainer/default.yaml driver")
    rollout = _yaml(CONF / "rollout" / "default.yaml")
    assert set(rollout) == {f.name for f in dataclasses.fields(ReplicaSettings)}
    _same_values(rollout, _defaults(ReplicaSettings), "rollout/default.yaml")


def test_model_yamls_have_the_settings_keys_and_local_is_the_defaults():
    keys = {f.name for f in dataclasses.fields(ModelSettings)}
    sft_keys = {f.name for f in dataclasses.fields(SFTSettings)}
    for path in sorted((CONF / "model").glob("*.yaml")):
        data = _yaml(path)
        assert set(data) == keys, path.name
        assert set(data["sft"]) == sft_keys, path.name
    local = _yaml(CONF / "model" / "local.yaml")
    _same_values(local, _defaults(ModelSettings), "model/local.yaml", skip=("dir",))  # dir: ??? (required)
    assert dataclasses.fields(ModelSettings)[0].name == "dir" and field_default(
        dataclasses.fields(ModelSettings)[0]) is dataclasses.MISSING


@pytest.mark.parametrize("name", sorted(ENV_SETTINGS))
def test_each_env_yaml_is_its_settings_class_field_for_field_and_value_for_value(name):
    cls = ENV_SETTINGS[name]
    data = _yaml(CONF / "env" / f"{name}.yaml")
    assert data["name"] == name
    # env.module belongs to envs of outside modules (docs/own_env.md): a built-in env's YAML leaves it out
    assert set(data) == {f.name for f in dataclasses.fields(cls)} - {"module"}
    _same_values(data, _defaults(cls), f"env/{name}.yaml")


def test_every_config_the_cli_composes_checks_the_same_as_its_settings(tmp_path):
    """A value the settings refuse is refused by the CLI's check, with the same line."""
    from async_rl.train import check_config, compose_command_line, with_run_dir_overrides

    def error(*overrides: str) -> str:
        cfg = compose_command_line(with_run_dir_overrides([*overrides, f"trainer.output_dir={tmp_path}"]))
        with pytest.raises(ConfigError) as info:
            check_config(cfg)
        return str(info.value)

    assert error("env=webshop", "env.page_size=0") == "env.page_size=0: must be an integer >= 1"
    assert error("model.max_position_embeddings=1") == "model.max_position_embeddings=1: must be null or an " \
                                                       "integer >= 2"
    assert error("rollout.vllm_max_num_seqs=0") == "rollout.vllm_max_num_seqs=0: must be an integer >= 1"
    assert error("trainer.driver.keep_last=0") == "trainer.driver.keep_last=0: must be an integer >= 1"
    assert error("algorithm.gate.eta_a=2") == "algorithm.gate.eta_a=2: must be a finite number in [0, 1]"


# ---------------------------------------------------------------------------------------- fill_from
@dataclasses.dataclass
class _Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    unrelated: int = 0


@dataclasses.dataclass
class _Limits:
    max_turns: int = 4
    top_p: float = 0.5


@dataclasses.dataclass
class _Spec:
    temperature: float = 0.0
    top_p: float = 0.0
    max_turns: int = 0
    seed: int = 7


def test_fill_from_takes_each_field_from_the_first_source_that_has_it_and_given_values_first():
    spec = fill_from(_Spec, _Sampling(temperature=0.7, top_p=0.9), _Limits(max_turns=3), seed=11)
    assert spec == _Spec(temperature=0.7, top_p=0.9, max_turns=3, seed=11)  # top_p: the first source's
    assert fill_from(_Spec, _Limits(max_turns=2)) == _Spec(top_p=0.5, max_turns=2)  # the rest keep their defaults
    assert fill_from(_Spec, _Sampling(), top_p=0.25).top_p == 0.25


def test_the_run_spec_is_filled_from_the_checked_settings(tmp_path):
    """train.run builds RunSpec, EpisodeLimits and TrainingSettings from the settings of the same names: every
    trainer/env value a user sets reaches them (not a hand-written copy that can drop one)."""
    from async_rl.assemble import RunSpec
    from async_rl.driver.episode import EpisodeLimits
    from async_rl.engine.settings import TrainingSettings
    from async_rl.envs.settings import env_settings

    trainer = TrainerSettings(temperature=0.5, top_p=1.0, max_grad_norm=0.3, micro_batch_size=2, workers="local",
                              precision="bf16", max_tokens_per_micro_batch=64, activation_checkpointing=True)
    env = env_settings({**_yaml(CONF / "env" / "retool.yaml"), "max_turns": 3, "max_new_tokens": 17})
    spec = fill_from(RunSpec, trainer, env, model_path="m", stop_strings=tuple(env.stop_strings),
                     limits=fill_from(EpisodeLimits, env), training=fill_from(TrainingSettings, trainer))
    assert (spec.temperature, spec.max_grad_norm, spec.micro_batch_size, spec.max_new_tokens) == (0.5, 0.3, 2, 17)
    assert spec.stop_strings == ("</code>",)
    assert (spec.limits.max_turns, spec.limits.max_response_tokens, spec.limits.env_timeout_s) == (3, 16384, 60.0)
    assert (spec.training.precision, spec.training.max_tokens_per_micro_batch,
            spec.training.activation_checkpointing) == ("bf16", 64, True)


def test_train_py_copies_no_settings_field_by_hand():
    source = (REPO / "src" / "async_rl" / "train.py").read_text()
    for copied in ("temperature=cfg.trainer", "max_grad_norm=cfg.trainer", "EpisodeLimits(cfg.env",
                   "precision=cfg.trainer", "TrainingSettings(precision"):
        assert copied not in source


# ---------------------------------------------------------------------------------------- command-line tools
@dataclasses.dataclass
class _ToolOptions:
    out: str = setting(meaning="where to write", non_empty=True)
    steps: int = setting(10, "optimizer steps", range=">= 1")
    noise: Optional[float] = setting(None, "wrong fraction", range="[0, 1]")
    mode: str = setting("fast", "how", choices=("fast", "slow"))
    verbose: bool = setting(False, "say more")
    ks: list[int] = setting([1, 2], "pass@k values")


def test_a_tool_parses_its_settings_class_with_types_defaults_and_checks():
    options = parse_settings(_ToolOptions, ["--out", "o", "--noise", "0.5", "--verbose", "--ks", "4", "8"])
    assert options == _ToolOptions(out="o", steps=10, noise=0.5, mode="fast", verbose=True, ks=[4, 8])
    assert parse_settings(_ToolOptions, ["--out", "o", "--noise", "null", "--no-verbose"]).noise is None


@pytest.mark.parametrize("argv,message", [
    (["--out", "o", "--steps", "0"], "--steps=0: must be an integer >= 1"),
    (["--out", "o", "--noise", "1.5"], r"--noise=1.5: must be null or a finite number in \[0, 1\]"),
    (["--out", "o", "--mode", "warp"], "invalid choice: 'warp'"),
    (["--steps", "3"], "the following arguments are required: --out"),
    (["--out", "o", "--steps", "three"], "invalid int value: 'three'"),
])
def test_a_bad_tool_option_exits_2_with_one_line_naming_it(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse_settings(_ToolOptions, argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert pytest.importorskip("re").search(message, err), err


@pytest.mark.parametrize("module,cls", [("async_rl.models.sft", SFTOptions), ("async_rl.models.tiny", TinyModelOptions),
                                        ("async_rl.plots", PlotOptions)])
def test_each_tools_help_lists_every_option_with_its_meaning(module, cls):
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    for name, f, _ in settings_fields(cls):
        flag = name if cls is PlotOptions and name == "runs" else "--" + name.replace("_", "-")
        assert flag in text, flag
        assert " ".join(f.metadata["meaning"].split())[:30] in text, name


def test_eval_options_are_checked_from_their_settings():
    from async_rl.eval import _validate

    cfg = OmegaConf.structured(EvalConfig)
    cfg.model_dir = "/m"
    for key, value, message in [("n_samples", 0, "n_samples=0: must be an integer >= 1"),
                                ("top_p", 0.0, r"top_p=0.0: must be a finite number in \(0, 1\]"),
                                ("device", "tpu", "device='tpu': must be one of cpu, cuda"),
                                ("limit", 0, "limit=0: must be null or an integer >= 1")]:
        bad = cfg.copy()
        bad[key] = value
        with pytest.raises(ConfigError, match=message):
            _validate(bad)


def test_env_keys_the_env_code_reads_are_settings_and_a_sandbox_option_of_the_other_kind_is_refused():
    retool = _yaml(CONF / "env" / "retool.yaml")
    assert check_env({**retool, "tool_prompt_template": None})["tool_prompt_template"] is None  # the bare question
    assert check_env({**retool, "sandbox": {**retool["sandbox"], "memory_limit_mb": 512}})["sandbox"][
        "memory_limit_mb"] == 512
    with pytest.raises(ConfigError, match="env.sandbox.max_processes=8 is an option of env.sandbox.kind=local only"):
        check_env({**retool, "sandbox": {**retool["sandbox"], "kind": "fusion", "max_processes": 8}})
    alfworld = {**_yaml(CONF / "env" / "alfworld.yaml"), "data_dir": "/data"}
    assert check_env({**alfworld, "categories": ["pick_and_place_simple"]})["categories"] == ["pick_and_place_simple"]
    # the YAML's template is the one the env shows (envs/retool.py)
    from async_rl.envs.retool import PROMPT_TEMPLATE, retool_env_kwargs

    assert retool_env_kwargs(OmegaConf.create(retool))["prompt_template"] == PROMPT_TEMPLATE


def test_env_facts_take_the_old_multi_turn_keyword_with_a_warning():
    from async_rl.envs.facts import EnvFacts

    with pytest.warns(DeprecationWarning, match="takes_max_turns"):
        assert EnvFacts(make_tasks=lambda cfg, seed: [], multi_turn=True).takes_max_turns
    assert not EnvFacts(make_tasks=lambda cfg, seed: []).takes_max_turns


@dataclasses.dataclass
class _OptionalChoice:
    engine: Optional[str] = setting("hf", "an engine or none", choices=("hf", "vllm"))
    out: Optional[str] = setting(None, "a folder")


def test_an_optional_option_with_choices_takes_none_and_free_text_keeps_the_word():
    assert parse_settings(_OptionalChoice, ["--engine", "none"]).engine is None
    assert parse_settings(_OptionalChoice, ["--engine", "vllm", "--out", "none"]) == _OptionalChoice("vllm", "none")
    with pytest.raises(SystemExit):
        parse_settings(_OptionalChoice, ["--engine", "tgi"])
