"""conf/algorithm/_base.yaml mirrors async_rl.config.AlgorithmConfig and each algorithm's YAML holds only its
differences from it; bad values fail with the valid choices; every
value of every config group is type- and range-checked with one line naming the key, the value and what is
allowed (issue 13, item 7)."""

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from async_rl.config import ALGORITHMS, AlgorithmConfig, algorithm_config_from_dict
from async_rl.driver.driver import DriverConfig
from async_rl.envs.settings import check_env
from async_rl.settings import check_model, check_trainer
from async_rl.validation import ConfigError, Rule, check_value, parse_range, settings_fields

CONF = Path(__file__).resolve().parents[1] / "conf"


def _keys(cls, prefix=""):
    out = set()
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out |= _keys(type(default), prefix + f.name + ".")
        else:
            out.add(prefix + f.name)
    return out


def _flat(d, prefix=""):
    out = set()
    for k, v in d.items():
        out |= _flat(v, prefix + k + ".") if isinstance(v, dict) else {prefix + k}
    return out


def _composed_algorithm(name: str) -> dict:
    """``algorithm=<name>`` as the CLI composes it (Hydra: _base.yaml, then the algorithm's own YAML)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return OmegaConf.to_container(compose(config_name="config", overrides=[f"algorithm={name}"]).algorithm)


def _flat_values(d, prefix=""):
    out = {}
    for k, v in d.items():
        out.update(_flat_values(v, prefix + k + ".") if isinstance(v, dict) else {prefix + k: v})
    return out


def test_base_yaml_is_the_dataclass_defaults_value_for_value():
    base = OmegaConf.to_container(OmegaConf.load(CONF / "algorithm" / "_base.yaml"))
    defaults = dataclasses.asdict(AlgorithmConfig())
    assert _flat(base) == _keys(AlgorithmConfig)
    want = {k: list(v) if isinstance(v, tuple) else v for k, v in _flat_values(defaults).items()}
    assert _flat_values(base) == want


@pytest.mark.parametrize("name", ALGORITHMS)
def test_algorithm_yaml_holds_only_its_differences_and_composes_to_a_valid_config(name):
    own = OmegaConf.to_container(OmegaConf.load(CONF / "algorithm" / f"{name}.yaml"))
    assert own.pop("defaults") == ["_base", "_self_"]
    base = _flat_values(OmegaConf.to_container(OmegaConf.load(CONF / "algorithm" / "_base.yaml")))
    repeated = {k: v for k, v in _flat_values(own).items() if k != "name" and base.get(k) == v}
    assert repeated == {}, f"{name}.yaml repeats _base.yaml's values: {repeated}"
    assert set(_flat_values(own)) <= set(base)
    data = _composed_algorithm(name)
    assert _flat(data) == _keys(AlgorithmConfig)
    cfg = algorithm_config_from_dict(data)
    assert cfg.name == name
    assert isinstance(cfg.actor_lr, float) and isinstance(cfg.gate.t_min, int)


def test_paper_defaults():
    li2sao = algorithm_config_from_dict(_composed_algorithm("li2sao"))
    assert (li2sao.group_size, li2sao.train_batch_trajectories) == (8, 128)
    assert (li2sao.gate.beta, li2sao.gate.eta_e, li2sao.gate.eta_a) == (0.9, 0.2, 0.65)
    assert (li2sao.gate.patience, li2sao.gate.t_min, li2sao.gate.t_max) == (10, 60, 150)
    assert (li2sao.clip.clip_ratio_low, li2sao.clip.clip_ratio_high) == (0.2, 0.28)  # DAPO (spec §2)
    lisao = algorithm_config_from_dict(_composed_algorithm("lisao"))
    assert (lisao.group_size, lisao.critic_warmup_steps, lisao.critic_updates_per_batch) == (1, 10, 2)
    assert lisao.critic_lr == 5e-6 and (lisao.dis.low, lisao.dis.high) == (0.7, 6.0)


def test_bad_values_fail_with_valid_choices():
    with pytest.raises(ValueError, match="valid choices: grpo, lisao, li2sao, ppo, sapo"):
        algorithm_config_from_dict({"name": "reinforce"})
    with pytest.raises(ValueError, match="divisible"):
        algorithm_config_from_dict({"name": "grpo", "train_batch_trajectories": 100, "group_size": 8})
    with pytest.raises(ValueError, match="unknown AlgorithmConfig keys"):
        algorithm_config_from_dict({"name": "grpo", "group_sise": 8})
    with pytest.raises(ValueError, match="use_critic"):
        algorithm_config_from_dict({"name": "lisao", "group_size": 1})


# ------------------------------------------------------------------------------------------------------
# type and range of every value (issue 13, item 7)
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("values,message", [
    ({"actor_lr": "abc"}, "algorithm.actor_lr='abc': must be a finite number > 0"),
    ({"actor_lr": 0}, "algorithm.actor_lr=0: must be a finite number > 0"),
    ({"critic_lr": -1e-6}, "algorithm.critic_lr=-1e-06: must be a finite number > 0"),
    ({"actor_lr": float("nan")}, "algorithm.actor_lr=nan"),
    ({"actor_lr": float("inf")}, "algorithm.actor_lr=inf"),
    ({"gamma": 1.01}, r"algorithm.gamma=1.01: must be a finite number in \[0, 1\]"),
    ({"gamma": -0.1}, "algorithm.gamma=-0.1"),
    ({"group_size": 0}, "algorithm.group_size=0: must be an integer >= 1"),
    ({"group_size": 2.5}, "algorithm.group_size=2.5: must be an integer >= 1"),
    ({"group_size": True}, "algorithm.group_size=True: must be an integer"),  # a bool is not a count
    ({"train_batch_trajectories": "128"}, "algorithm.train_batch_trajectories='128': must be an integer >= 1"),
    ({"clip": {"clip_ratio_low": -0.2}}, r"algorithm.clip.clip_ratio_low=-0.2: must be a finite number in \[0, 1\)"),
    ({"clip": {"clip_ratio_high": -1.0}}, "algorithm.clip.clip_ratio_high=-1.0: must be a finite number >= 0"),
    ({"clip": 0.2}, "algorithm.clip=0.2: must be a mapping of clip_ratio_low, clip_ratio_high"),
    ({"value_clip": -0.2}, "algorithm.value_clip=-0.2: must be a finite number >= 0"),
    ({"grpo_epsilon": 0.0}, "algorithm.grpo_epsilon=0.0: must be a finite number > 0"),
    ({"entropy_coef": -0.01}, "algorithm.entropy_coef=-0.01"),
    ({"gae_lambda": 1.5}, r"algorithm.gae_lambda=1.5: must be null or a finite number in \[0, 1\]"),
    ({"gae_alpha": 0}, "algorithm.gae_alpha=0: must be a finite number > 0"),
    ({"critic_updates_per_batch": 0}, "algorithm.critic_updates_per_batch=0: must be an integer >= 1"),
    ({"critic_warmup_steps": -1}, "algorithm.critic_warmup_steps=-1: must be an integer >= 0"),
    ({"dis": {"low": 1.2}}, r"algorithm.dis.low=1.2: must be a finite number in \(0, 1\)"),
    ({"dis": {"high": 0.9}}, "algorithm.dis.high=0.9: must be a finite number > 1"),
    ({"gate": {"beta": 1.0}}, r"algorithm.gate.beta=1.0: must be a finite number in \[0, 1\)"),
    ({"gate": {"patience": 0}}, "algorithm.gate.patience=0: must be an integer >= 1"),
    ({"gate": {"t_min": 100, "t_max": 50}}, "algorithm.gate.t_max=50: must be >= algorithm.gate.t_min=100"),
    ({"overlong_penalty": "yes"}, "algorithm.overlong_penalty='yes': must be true or false"),
    ({"use_critic": 1}, "algorithm.use_critic=1: must be true or false"),
    ({"policy_loss": 3}, "algorithm.policy_loss=3: must be one of ppo_clip, dis, dis_clip, vanilla"),
    ({"sapo_tau_v": 0.0}, "algorithm.sapo_tau_v=0.0: must be a finite number > 0"),
    ({"sapo_reserved_tokens": "<|value_plus|>"}, "algorithm.sapo_reserved_tokens='<|value_plus|>': must be a list"),
    ({"sapo_reserved_tokens": ["<a>", "<a>"]}, "must be two distinct non-empty token strings"),
])
def test_every_algorithm_value_is_type_and_range_checked(values, message):
    with pytest.raises(ConfigError, match=message):
        algorithm_config_from_dict({"name": "grpo", **values})


def test_every_algorithm_field_has_a_type_rule():
    # a field added to AlgorithmConfig is type-checked from its annotation at once (a bare `list` counts); its
    # meaning and range are test_settings.py's: nothing is left unchecked
    rules = {name: rule for name, _, rule in settings_fields(AlgorithmConfig) if rule is not None and
             rule.kind != "mapping"}
    assert set(rules) == _keys(AlgorithmConfig)


def test_numbers_are_normalised_to_the_annotated_type():
    cfg = algorithm_config_from_dict({"name": "li2sao", "use_critic": True, "policy_loss": "dis_clip", "actor_lr": 1,
                                      "train_batch_trajectories": 1.6e1, "group_size": 8, "gate": {"t_max": 2e2}})
    # int 1 for a float field -> 1.0; 1.6e1 (a float in YAML) for an int field -> 16
    assert (cfg.actor_lr, type(cfg.actor_lr)) == (1.0, float)
    assert (cfg.train_batch_trajectories, type(cfg.train_batch_trajectories)) == (16, int)
    assert (cfg.gate.t_max, type(cfg.gate.t_max)) == (200, int)


def test_range_text():
    assert parse_range("> 0").contains(1e-9) and not parse_range("> 0").contains(0.0)
    assert parse_range(">= 1").contains(1) and not parse_range(">= 1").contains(0)
    assert parse_range("[0, 1)").contains(0.0) and not parse_range("[0, 1)").contains(1.0)
    assert parse_range("(0, 1]").contains(1.0) and not parse_range("(0, 1]").contains(0.0)
    assert parse_range("<= 1").contains(-5) and not parse_range("<= 1").contains(1.5)
    with pytest.raises(ValueError, match="not of the form"):
        parse_range("positive")
    assert str(parse_range("(0, 1]")) == "in (0, 1]"


def test_driver_config_types_and_ranges():
    cfg = DriverConfig.from_dict({"total_steps": 10, "checkpoint_every": 2})
    cfg.validate(batch_size=8)
    assert (cfg.keep_last, cfg.total_steps) == (3, 10)  # default keep_last >= 2: a checkpoint to fall back to
    for values, message in [
        ({"total_steps": "abc"}, "trainer.driver.total_steps='abc': must be an integer >= 1"),
        ({"total_steps": 0}, "trainer.driver.total_steps=0: must be an integer >= 1"),
        ({"staleness_cap": -1}, "trainer.driver.staleness_cap=-1: must be an integer >= 0"),
        ({"chunk_tokens": 0}, "trainer.driver.chunk_tokens=0"),
        ({"update_ticks": -1}, "trainer.driver.update_ticks=-1"),
        ({"checkpoint_every": 1.5}, "trainer.driver.checkpoint_every=1.5: must be an integer >= 0"),
        ({"keep_last": 0}, "trainer.driver.keep_last=0: must be an integer >= 1"),
        ({"max_inflight_trajectories": 0}, "trainer.driver.max_inflight_trajectories=0: must be null or an integer"),
        ({"buffer_capacity": 4}, r"trainer.driver.buffer_capacity=4: must hold at least one batch \(8"),
        ({"synchronous": "no"}, "trainer.driver.synchronous='no': must be true or false"),
    ]:
        with pytest.raises(ConfigError, match=message):
            DriverConfig.from_dict(values).validate(batch_size=8)
    with pytest.raises(ConfigError, match=r"unknown DriverConfig keys \['total_step'\] under trainer.driver"):
        DriverConfig.from_dict({"total_step": 5})


def _group(name):
    return OmegaConf.to_container(OmegaConf.load(CONF / name), resolve=False)


@pytest.mark.parametrize("env", ["toy_keys", "toy_echo", "math", "retool", "webshop", "alfworld", "reasoning_gym"])
def test_shipped_env_configs_pass(env):
    data = _group(f"env/{env}.yaml")
    data.pop("data_dir", None)  # alfworld's data_dir is an ${oc.env:...} interpolation, resolved by Hydra
    assert check_env(data)["name"] == env


def test_shipped_trainer_and_model_configs_pass():
    trainer = _group("trainer/default.yaml")
    trainer["run_name"] = "r"  # an interpolation of the algorithm and env names
    assert check_trainer(trainer).scheduler == "deterministic"
    DriverConfig.from_dict(trainer["driver"]).validate(128)
    tiny = _group("model/tiny.yaml")
    tiny["dir"] = "outputs/models/tiny"
    assert check_model(tiny)["build_tiny"] is True


@pytest.mark.parametrize("env,values,message", [
    ("toy_keys", {"max_turns": -1}, "env.max_turns=-1: must be an integer >= 1"),
    ("toy_keys", {"max_turns": "four"}, "env.max_turns='four'"),
    ("toy_keys", {"env_timeout_s": 0}, "env.env_timeout_s=0: must be a finite number > 0"),
    ("toy_keys", {"env_timeout_s": "30s"}, "env.env_timeout_s='30s'"),
    ("toy_keys", {"max_response_tokens": 0}, "env.max_response_tokens=0: must be an integer >= 1"),
    ("toy_keys", {"max_new_tokens": 0}, "env.max_new_tokens=0"),
    ("toy_keys", {"num_tasks": 0}, "env.num_tasks=0: must be an integer >= 1"),
    ("toy_keys", {"name": "chess"}, "env.name='chess': must be one of toy_keys, toy_echo, math"),
    ("toy_keys", {"stop_strings": "</code>"}, "env.stop_strings='</code>': must be null or a list of strings"),
    ("math", {"verify_timeout_s": -1.0}, "env.verify_timeout_s=-1.0: must be a finite number > 0"),
    ("math", {"dedupe": "true"}, "env.dedupe='true': must be true or false"),
    ("retool", {"code_timeout_s": 0}, "env.code_timeout_s=0"),
    ("retool", {"env_timeout_s": 10.0, "code_timeout_s": 10.0}, "env.env_timeout_s=10.0: must exceed env.code_timeout_s"),
    ("retool", {"sandbox": {"kind": "docker"}}, "env.sandbox.kind='docker': must be one of local, fusion"),
    ("retool", {"max_observation_chars": 8}, "env.max_observation_chars=8: must be an integer >= 16"),
    ("webshop", {"server_timeout_s": 0}, "env.server_timeout_s=0"),
    ("webshop", {"backend": "amazon"}, "env.backend='amazon': must be one of simulator, server"),
    ("webshop", {"goal_range": [10, 5]}, r"env.goal_range=\[10, 5\]: must be \[start, stop\)"),
    ("webshop", {"history_length": -1}, "env.history_length=-1: must be an integer >= 0"),
    ("alfworld", {"split": "test"}, "env.split='test': must be one of train, valid_seen"),
    ("alfworld", {"num_tasks": -1}, "env.num_tasks=-1: must be an integer >= 0"),  # 0 = every game
    ("math", {"fallback_last_number": "no"}, "env.fallback_last_number='no': must be true or false"),
    ("webshop", {"reset_timeout_s": 5}, "env.reset_timeout_s is not a setting of env=webshop; valid keys: name"),
    # an env of an outside module: its own keys are its module's, but a timeout is held to what its name promises
    ("webshop", {"name": "shop2", "module": "my_envs.shop", "reset_timeout_s": -2},
     "env.reset_timeout_s=-2: must be a finite number > 0"),
])
def test_env_values_are_type_and_range_checked(env, values, message):
    data = {**_group(f"env/{env}.yaml"), **({"data_dir": "/data"} if env == "alfworld" else {})}
    data.update(values)
    if env == "retool" and "sandbox" in values:
        data["sandbox"] = {"url": "http://x", **values["sandbox"]}
    with pytest.raises(ConfigError, match=message):
        check_env(data)


@pytest.mark.parametrize("group,values,message", [
    ("trainer", {"device": "gpu"}, "trainer.device='gpu': must be one of cpu, cuda, auto"),
    ("trainer", {"temperature": 0}, "trainer.temperature=0: must be a finite number > 0"),
    ("trainer", {"top_p": 1.5}, r"trainer.top_p=1.5: must be a finite number in \(0, 1\]"),
    ("trainer", {"top_p": 0.9}, r"trainer.top_p=0.9: training needs 1.0; the trainer's log-probs have no nucleus "
                                r"truncation, so with a behaviour-log-prob loss the on-policy ratio"),
    ("trainer", {"train_workers": 0}, "trainer.train_workers=0"),
    ("trainer", {"torch_threads": 0}, "trainer.torch_threads=0: must be null or an integer >= 1"),
    ("trainer", {"micro_batch_size": "all"}, "trainer.micro_batch_size='all'"),
    ("trainer", {"max_grad_norm": -1.0}, "trainer.max_grad_norm=-1.0: must be null or a finite number > 0"),
    ("trainer", {"resume": "yes"}, "trainer.resume='yes': must be true or false"),
    ("trainer", {"run_name": ""}, "trainer.run_name='': must be a non-empty string"),
    ("trainer", {"driver": 5}, "trainer.driver=5: must be a mapping"),
    ("model", {"hidden_size": 30}, "model.hidden_size=30: must be a multiple of 8"),
    ("model", {"num_layers": 0}, "model.num_layers=0: must be null or an integer >= 1"),
    ("model", {"dir": "???"}, "model.dir is not set"),
    ("model", {"sft": {"enabled": True, "noise": 1.5, "steps": None}}, r"model.sft.noise=1.5: must be null or a finite number in \[0, 1\]"),
    ("model", {"sft": {"enabled": "on"}}, "model.sft.enabled='on': must be true or false"),
])
def test_trainer_and_model_values_are_type_and_range_checked(group, values, message):
    data = _group("trainer/default.yaml" if group == "trainer" else "model/tiny.yaml")
    data.update({"run_name": "r"} if group == "trainer" else {"dir": "m"})
    data.update(values)
    with pytest.raises(ConfigError, match=message):
        (check_trainer if group == "trainer" else check_model)(data)


def test_check_value_keeps_unrelated_types_out():
    assert check_value("k", None, Rule("int", ">= 1", optional=True)) is None
    assert check_value("k", [1, 2], Rule("list", items="int")) == [1, 2]
    with pytest.raises(ConfigError, match=r"k\[1\]='b': must be an integer"):
        check_value("k", [1, "b"], Rule("list", items="int"))
    with pytest.raises(ConfigError, match="k=None: must be an integer >= 1"):
        check_value("k", None, Rule("int", ">= 1"))


def test_trainer_yaml_driver_mirrors_driver_config():
    driver = _group("trainer/default.yaml")["driver"]
    assert set(driver) == {f.name for f in dataclasses.fields(DriverConfig)}
    assert driver["keep_last"] >= 2  # the documented default leaves a previous checkpoint to fall back to


def test_a_truncated_sampler_is_refused_for_training_in_one_line_and_top_p_1_passes(tmp_path):
    """top_p < 1 / top_k > 0: the trainer's pi_theta is the full tempered softmax, the sampler's mu is truncated, so
    the on-policy ratio of every behaviour-log-prob loss would not be 1; refused at config time, in one line naming
    the key (the whole run's config too, before anything loads)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from async_rl.train import check_run_config
    from async_rl.validation import check_training_sampling

    check_training_sampling(1.0)
    check_training_sampling(1.0, top_k=-1)
    check_training_sampling(1.0, top_k=0)
    with pytest.raises(ConfigError, match=r"^trainer.top_k=40: training needs top_k off") as error:
        check_training_sampling(1.0, top_k=40)
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match=r"^trainer.top_p=0.95: training needs 1.0; .*top-p is for evaluation only"):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF), version_base=None):
            cfg = compose(config_name="config", overrides=["trainer.top_p=0.95", f"trainer.output_dir={tmp_path}"])
        check_run_config(cfg)
    assert not any(tmp_path.iterdir())  # nothing built
