"""Type and range checks of every config value, run before any model loads (issue 13, item 7).

One rule per value: its type (read from the dataclass annotation for ``AlgorithmConfig`` / ``DriverConfig``,
written out below for the free-form env, trainer and model groups) and its allowed range. A bad value raises
:class:`ConfigError` with one line that names the key as the user types it on the command line, the value
and what is allowed, e.g.::

    trainer.driver.total_steps='abc': must be an integer >= 1

The CLI (``async_rl.train``) prints such errors as ``error: <message>`` and exits with status 2.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Mapping, Optional


class ConfigError(ValueError):
    """A config value that is wrong; the message names the key, the value and what is allowed."""


# ----------------------------------------------------------------------------------------------------------
# ranges: "> 0", ">= 1", "[0, 1]", "[0, 1)", "(0, 1]" -- parsed once, checked on numbers
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Range:
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False  # True: value > low; False: value >= low
    high_open: bool = False

    def contains(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return False
        return True

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_num(self.low)}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {_num(self.high)}"
        return ""


_BOUND = re.compile(r"^\s*(>=|>|<=|<)\s*(\S+)\s*$")
_INTERVAL = re.compile(r"^\s*([\[(])\s*(\S+)\s*,\s*(\S+)\s*([\])])\s*$")


def parse_range(text: str) -> Range:
    """``"> 0"``, ``">= 1"``, ``"<= 1"``, ``"[0, 1]"``, ``"[0, 1)"`` -> :class:`Range`."""
    bound = _BOUND.match(text)
    if bound:
        op, number = bound.group(1), float(bound.group(2))
        if op.startswith(">"):
            return Range(low=number, low_open=op == ">")
        return Range(high=number, high_open=op == "<")
    interval = _INTERVAL.match(text)
    if interval:
        return Range(float(interval.group(2)), float(interval.group(3)), interval.group(1) == "(",
                     interval.group(4) == ")")
    raise ValueError(f"range {text!r} is not of the form '> 0', '>= 1', '[0, 1]' or '[0, 1)'")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


# ----------------------------------------------------------------------------------------------------------
# one value
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """What one config value may be. ``kind``: int, float, bool, str, list, mapping or any."""

    kind: str
    range: Optional[str] = None  # for int / float, see parse_range
    choices: Optional[tuple] = None  # for str (or any kind): the allowed values
    optional: bool = False  # None (YAML null) allowed
    items: Optional[str] = None  # for list: the kind of every item (int, float, str)
    non_empty: bool = False  # for str / list: "" and [] are not allowed

    def describe(self) -> str:
        if self.choices is not None:
            text = "one of " + ", ".join(str(c) for c in self.choices)
        elif self.kind == "int":
            text = "an integer" + (f" {parse_range(self.range)}" if self.range else "")
        elif self.kind == "float":
            text = "a finite number" + (f" {parse_range(self.range)}" if self.range else "")
        elif self.kind == "bool":
            text = "true or false"
        elif self.kind == "str":
            text = "a non-empty string" if self.non_empty else "a string"
        elif self.kind == "list":
            text = ("a non-empty list" if self.non_empty else "a list") + \
                (f" of {_ITEM_NAMES[self.items]}" if self.items else "")
        elif self.kind == "mapping":
            text = "a mapping of keys to values"
        else:
            text = "any value"
        return f"null or {text}" if self.optional else text


_ITEM_NAMES = {"int": "integers", "float": "numbers", "str": "strings", "bool": "booleans"}


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_value(key: str, value: Any, rule: Rule) -> Any:
    """Return ``value`` (ints given for a float become floats; integral floats given for an int become
    ints) or raise :class:`ConfigError` naming ``key``, the value and ``rule.describe()``."""

    given = value  # shown as the user wrote it, before any int -> float normalisation

    def fail() -> None:
        raise ConfigError(f"{key}={_show(given)}: must be {rule.describe()}")

    if value is None:
        if not rule.optional:
            fail()
        return None
    kind = rule.kind
    if kind == "int":
        # bool is an int subclass: `true` is not a step count
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)  # 1e3 from YAML means 1000
        if isinstance(value, bool) or not isinstance(value, int):
            fail()
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            fail()
        value = float(value)
    elif kind == "bool":
        if not isinstance(value, bool):
            fail()
    elif kind == "str":
        if not isinstance(value, str) or (rule.non_empty and not value):
            fail()
    elif kind == "list":
        if not isinstance(value, (list, tuple)) or (rule.non_empty and not value):
            fail()
        if rule.items is not None:
            item_rule = Rule(rule.items)
            value = [check_value(f"{key}[{i}]", item, item_rule) for i, item in enumerate(value)]
    elif kind == "mapping":
        if not isinstance(value, Mapping):
            fail()
    if rule.choices is not None and value not in rule.choices:
        fail()
    if rule.range is not None and kind in ("int", "float") and not parse_range(rule.range).contains(value):
        fail()
    return value


def check_mapping(prefix: str, values: Mapping[str, Any], rules: Mapping[str, Rule]) -> dict[str, Any]:
    """Check every key of ``values`` that has a rule (nested mappings by their dotted key); keys without a
    rule are passed through unchanged (other parts of the code own them). Returns the checked copy."""
    out = dict(values)
    for key, rule in rules.items():
        head, _, rest = key.partition(".")
        if rest:  # a key of a nested mapping, e.g. "sft.steps"
            inner = out.get(head)
            if isinstance(inner, Mapping) and rest.split(".")[0] in inner:
                out[head] = {**inner, **check_mapping(f"{prefix}.{head}", inner, {rest: rule})}
            continue
        if head in out:
            out[head] = check_value(f"{prefix}.{head}", out[head], rule)
    return out


# ----------------------------------------------------------------------------------------------------------
# dataclasses: the type comes from the annotation, the range from a table (or the field's naming convention)
# ----------------------------------------------------------------------------------------------------------
# Fallback ranges for numeric fields that the table does not name, by the meaning their names carry, so a
# newly added field is range-checked at once. The first matching pattern wins.
CONVENTION_RANGES: tuple[tuple[str, str], ...] = (
    (r"(^|_)lr$", "> 0"),  # learning rates
    (r"group_size$", ">= 1"),
    (r"(^|_)(gamma|lambda)$", "[0, 1]"),  # discount / GAE λ
    (r"(^|_)(eps|epsilon)$", "> 0"),  # denominators' ε
    (r"clip", ">= 0"),  # clip ε of any loss
    (r"(^|_)coef$", ">= 0"),  # loss weights
    (r"(^|_)(steps|updates|patience)($|_)", ">= 0"),
    (r"timeout", "> 0"),
)


def convention_range(name: str) -> Optional[str]:
    for pattern, text in CONVENTION_RANGES:
        if re.search(pattern, name):
            return text
    return None


def _rule_for_annotation(annotation: Any) -> tuple[Optional[Rule], Optional[type]]:
    """(rule, nested dataclass type) for a field annotation; (None, None) when the type is not checked."""
    optional = False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        if len(args) != 1:
            return None, None  # a real union (int | str): not checked here
        annotation = args[0]
        origin = typing.get_origin(annotation)
    if dataclasses.is_dataclass(annotation):
        return Rule("mapping", optional=optional), annotation
    if origin is typing.Literal:
        return Rule("any", choices=tuple(typing.get_args(annotation)), optional=optional), None
    if annotation in (list, tuple) or origin in (list, tuple):
        args = typing.get_args(annotation)
        item = args[0] if args else None
        items = {int: "int", float: "float", str: "str", bool: "bool"}.get(item)
        return Rule("list", optional=optional, items=items), None
    kind = {int: "int", float: "float", bool: "bool", str: "str", dict: "mapping"}.get(annotation)
    if kind is None:
        return None, None
    return Rule(kind, optional=optional), None


def dataclass_rules(cls: type, ranges: Mapping[str, str], prefix: str = "") -> dict[str, Rule]:
    """Dotted field name -> :class:`Rule` for every field of ``cls`` and its nested dataclasses: type from
    the annotation, range from ``ranges`` (dotted names) or :data:`CONVENTION_RANGES`."""
    hints = typing.get_type_hints(cls)
    rules: dict[str, Rule] = {}
    for f in dataclasses.fields(cls):
        rule, nested = _rule_for_annotation(hints[f.name])
        dotted = prefix + f.name
        if nested is not None:
            rules.update(dataclass_rules(nested, ranges, dotted + "."))
            continue
        if rule is None:
            continue
        if rule.kind in ("int", "float"):
            text = ranges.get(dotted, convention_range(f.name))
            rule = dataclasses.replace(rule, range=text)
        rules[dotted] = rule
    return rules


def check_dataclass(obj: Any, prefix: str, ranges: Mapping[str, str]) -> None:
    """Check (and normalise in place: int -> float for float fields) every field of the dataclass instance
    ``obj`` and its nested dataclasses. ``prefix`` is the config group as typed on the command line."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        rule, nested = _rule_for_annotation(hints[f.name])
        value = getattr(obj, f.name)
        key = f"{prefix}.{f.name}"
        if nested is not None:
            if value is None and rule.optional:
                continue
            if not isinstance(value, nested):
                raise ConfigError(f"{key}={_show(value)}: must be a mapping of "
                                  f"{', '.join(g.name for g in dataclasses.fields(nested))}")
            check_dataclass(value, key, {k[len(f.name) + 1:]: v for k, v in ranges.items()
                                         if k.startswith(f.name + ".")})
            continue
        if rule is None:
            continue
        if rule.kind in ("int", "float"):
            rule = dataclasses.replace(rule, range=ranges.get(f.name, convention_range(f.name)))
        setattr(obj, f.name, check_value(key, value, rule))


def dataclass_from_mapping(cls: type, values: Any, prefix: str) -> Any:
    """Build ``cls`` from a plain mapping, nested dataclasses from nested mappings; an unknown key or a
    non-mapping fails with the valid keys."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"{prefix}={_show(values)}: must be a mapping with keys "
                          f"{', '.join(f.name for f in dataclasses.fields(cls))}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} keys {unknown} under {prefix}; valid keys: {sorted(known)}")
    kwargs = {}
    for key, value in values.items():
        _, nested = _rule_for_annotation(hints[key])
        kwargs[key] = dataclass_from_mapping(nested, value, f"{prefix}.{key}") \
            if nested is not None and isinstance(value, Mapping) else value
    return cls(**kwargs)


# ----------------------------------------------------------------------------------------------------------
# env, trainer, model and the top level (free-form Hydra groups: rules written out)
# ----------------------------------------------------------------------------------------------------------
TASK_ENVS = ("toy_keys", "toy_echo", "math", "retool", "webshop", "alfworld", "reasoning_gym")
ALFWORLD_SPLITS = ("train", "valid_seen", "valid_unseen", "eval_in_distribution", "eval_out_of_distribution")

_COMMON_ENV_RULES = {
    "name": Rule("str", choices=TASK_ENVS),
    "max_turns": Rule("int", ">= 1"),
    "max_new_tokens": Rule("int", ">= 1"),
    "max_response_tokens": Rule("int", ">= 1"),
    "env_timeout_s": Rule("float", "> 0"),
    "stop_strings": Rule("list", optional=True, items="str"),
}
_DATA_FILE_RULES = {  # math and retool read the same data loader keys
    "train_data": Rule("str", non_empty=True),
    "train_split": Rule("str", non_empty=True),
    "eval_sets": Rule("list", optional=True),
    "num_tasks": Rule("int", ">= 1", optional=True),
    "prompt_key": Rule("str", optional=True),
    "answer_key": Rule("str", optional=True),
    "id_key": Rule("str", optional=True),
    "strip_dapo_instruction": Rule("bool"),
    "prompt_template": Rule("str", optional=True),
    "dedupe": Rule("bool"),
    "allow_hub": Rule("bool"),
    "cache_dir": Rule("str", optional=True),
    "verify_timeout_s": Rule("float", "> 0"),
    "fallback_last_number": Rule("bool"),  # the grader's last-number fallback (off in every recipe)
}
ENV_RULES: dict[str, dict[str, Rule]] = {
    "toy_keys": {"num_tasks": Rule("int", ">= 1")},
    "toy_echo": {"num_tasks": Rule("int", ">= 1")},
    "math": dict(_DATA_FILE_RULES),
    "retool": {
        **_DATA_FILE_RULES,
        "tool_prompt_template": Rule("str", optional=True),
        "code_timeout_s": Rule("float", "> 0"),
        "max_observation_chars": Rule("int", ">= 16"),  # ReToolEnv keeps a head and a tail of the output
        "persist_state": Rule("bool"),
        "sandbox": Rule("mapping"),
        "sandbox.kind": Rule("str", choices=("local", "fusion")),
        "sandbox.url": Rule("str", optional=True),
    },
    "webshop": {
        "backend": Rule("str", choices=("simulator", "server")),
        "server_url": Rule("str", non_empty=True),
        "server_timeout_s": Rule("float", "> 0"),
        "num_tasks": Rule("int", ">= 1"),
        "split": Rule("str", choices=("train", "test", "all")),
        "history_length": Rule("int", ">= 0"),
        "catalog_seed": Rule("int", ">= 0"),
        "num_products": Rule("int", ">= 1"),
        "num_goals": Rule("int", ">= 1"),
        "num_test_goals": Rule("int", ">= 0"),
        "goal_range": Rule("list", optional=True, items="int"),
        "check_instruction": Rule("bool"),
        "eval_split": Rule("str", choices=("train", "test", "all")),
    },
    "reasoning_gym": {  # any reasoning-gym dataset (envs/reasoning_gym_env.py); names checked against the package
        "dataset": Rule("str", non_empty=True),
        "dataset_config": Rule("mapping", optional=True),
        "data_seed": Rule("int", ">= 0"),
        "num_train": Rule("int", ">= 1"),
        "num_eval": Rule("int", ">= 0"),
        "split": Rule("str", choices=("train", "eval")),
        "eval_split": Rule("str", choices=("eval",)),
        "num_tasks": Rule("int", ">= 1", optional=True),
        "answer_format": Rule("str", choices=("answer_tag", "hashes", "boxed")),
        "prompt_template": Rule("str", optional=True),
    },
    "alfworld": {
        "data_dir": Rule("str", non_empty=True),
        "split": Rule("str", choices=ALFWORLD_SPLITS),
        "num_tasks": Rule("int", ">= 0"),  # 0 = every game of the split
        "history_length": Rule("int", ">= 0"),
        "eval_split": Rule("str", choices=ALFWORLD_SPLITS),
    },
}

TRAINER_RULES: dict[str, Rule] = {
    "run_name": Rule("str", non_empty=True),
    "output_dir": Rule("str", non_empty=True),
    "scheduler": Rule("str", choices=("deterministic", "concurrent")),
    "device": Rule("str", choices=("cpu", "cuda", "auto")),
    "require_gpu": Rule("bool"),
    "cpu_variant": Rule("str", optional=True),
    "workers": Rule("str", choices=("local", "ray")),
    "train_workers": Rule("int", ">= 1"),
    "wandb": Rule("bool"),
    "project": Rule("str", non_empty=True),
    "temperature": Rule("float", "> 0"),
    "top_p": Rule("float", "(0, 1]"),
    "max_grad_norm": Rule("float", "> 0", optional=True),  # null = no gradient clipping
    "torch_threads": Rule("int", ">= 1", optional=True),
    "micro_batch_size": Rule("int", ">= 1", optional=True),
    "precision": Rule("str", choices=("fp32", "bf16")),  # docs/engine.md §7
    "max_tokens_per_micro_batch": Rule("int", ">= 1", optional=True),
    "activation_checkpointing": Rule("bool"),
    "resume": Rule("bool"),
    "overwrite": Rule("bool"),
    "export_model": Rule("bool"),
    "driver": Rule("mapping"),
}

# ``model.attn_implementation``: the attention kernels of the trained models (transformers' names), checked in
# full (flash-attn installed, CUDA, bf16) by :func:`check_attn_implementation`. sdpa is PyTorch's own
# (CPU and GPU, any dtype); flash_attention_2 needs the optional flash-attn package, a CUDA GPU and half-precision
# compute; eager is the reference implementation (slow, for debugging).
ATTN_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "eager")

FLASH_ATTN_INSTALL = ("pip install flash-attn --no-build-isolation (a wheel must match your CUDA and torch; "
                      "see docs/engine.md)")


def check_attn_implementation(name: str, device: str = "cpu", precision: str = "fp32") -> str:
    """Return ``name`` if the trained models can use it here; otherwise raise a one-line ``ValueError``
    naming the fix (the install line for flash-attn, or the setting to change)."""
    if name not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"model.attn_implementation={name!r}; valid choices: {', '.join(ATTN_IMPLEMENTATIONS)}")
    if name != "flash_attention_2":
        return name
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:
        raise ValueError("model.attn_implementation=flash_attention_2 needs the flash-attn package, which is not "
                         f"installed: {FLASH_ATTN_INSTALL}; or use model.attn_implementation=sdpa")
    if not str(device).startswith("cuda"):
        raise ValueError(f"model.attn_implementation=flash_attention_2 runs on CUDA GPUs only (device {device}); "
                         "use model.attn_implementation=sdpa")
    if precision != "bf16":
        raise ValueError(f"model.attn_implementation=flash_attention_2 needs half-precision compute "
                         f"(trainer.precision={precision}); set trainer.precision=bf16 or use sdpa")
    return name


# ``model.packaged``: pretrained models shipped inside a PyPI package, converted once into ``model.dir``
# (``async_rl.models.packaged.PACKAGED_MODELS``; listed here so validation imports no model code)
PACKAGED_MODEL_NAMES = ("smollm2",)

MODEL_RULES: dict[str, Rule] = {
    "dir": Rule("str", non_empty=True),
    "packaged": Rule("str", choices=PACKAGED_MODEL_NAMES, optional=True),
    "build_tiny": Rule("bool"),
    "hidden_size": Rule("int", ">= 8", optional=True),
    "num_layers": Rule("int", ">= 1", optional=True),
    "attn_implementation": Rule("str", choices=ATTN_IMPLEMENTATIONS),
    "sft": Rule("mapping"),
    "sft.enabled": Rule("bool"),
    "sft.noise": Rule("float", "[0, 1]", optional=True),
    "sft.steps": Rule("int", ">= 1", optional=True),
    "sft.dir": Rule("str", optional=True),  # where the warm-started model is cached (null: <dir>/sft)
    "sft.lr": Rule("float", "> 0", optional=True),  # SFT learning rate (null: the tiny model's tuned default)
}

# numpy's seed range: every seed must be accepted by random, numpy and torch alike
SEED_RULE = Rule("int", f"[0, {2 ** 32 - 1}]")


#: ``env.module``: an importable module outside this package that registers the env named ``env.name`` (and its
#: facts) when imported; the run imports it before it makes tasks or envs (docs/own_env.md)
ENV_MODULE_RULE = Rule("str", optional=True, non_empty=True)
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def check_env(env: Mapping[str, Any]) -> dict[str, Any]:
    """Checked copy of the ``env`` group: common keys, then the keys of ``env.name``'s group. An env of an outside
    module (``env.module``) may have any name; its own keys are its module's to check."""
    env = check_mapping("env", env, {"module": ENV_MODULE_RULE})
    module = env.get("module")
    if module is not None and not _MODULE_NAME.match(module):
        raise ConfigError(f"env.module={module!r}: must be an importable module name such as my_pkg.my_env")
    name_rule = Rule("str", non_empty=True) if module else _COMMON_ENV_RULES["name"]
    env = check_mapping("env", env, {"name": name_rule})
    if "name" not in env:
        raise ConfigError(f"env.name is missing: choose env=<{'|'.join(TASK_ENVS)}>")
    env = check_mapping("env", env, {**_COMMON_ENV_RULES, "name": name_rule})
    own_rules = ENV_RULES.get(env["name"], {})
    env = check_mapping("env", env, own_rules)
    # a key added to an env group without a rule here is still held to what its name promises
    known = set(_COMMON_ENV_RULES) | set(own_rules) | {"module"}
    env = check_mapping("env", env, {key: Rule("float", "> 0") for key in env
                                     if key not in known and key.endswith("_timeout_s")})
    for key in ("max_turns", "max_new_tokens", "max_response_tokens", "env_timeout_s"):
        if key not in env:
            raise ConfigError(f"env.{key} is missing: set it in the env's YAML (env/{env['name']}.yaml)")
    # checks of keys only some groups have (retool's code_timeout_s, webshop's goal_range)
    if env.get("code_timeout_s") is not None and env["env_timeout_s"] <= env["code_timeout_s"]:
        raise ConfigError(f"env.env_timeout_s={env['env_timeout_s']}: must exceed env.code_timeout_s="
                          f"{env['code_timeout_s']} (a code run that times out is shown to the model, not aborted)")
    goal_range = env.get("goal_range")
    if goal_range is not None and (len(goal_range) != 2 or not 0 <= goal_range[0] < goal_range[1]):
        raise ConfigError(f"env.goal_range={goal_range}: must be [start, stop) with 0 <= start < stop")
    return env


def check_model(model: Mapping[str, Any]) -> dict[str, Any]:
    model = check_mapping("model", model, MODEL_RULES)
    if model.get("dir") in (None, "???"):
        raise ConfigError("model.dir is not set: give model.dir=/path/to/model (or use model=tiny)")
    if model.get("packaged") and model.get("build_tiny"):
        raise ConfigError(f"model.packaged={model['packaged']} with model.build_tiny=true: choose one (the packaged "
                          "model is converted into model.dir; build_tiny builds a random tiny one there)")
    if model.get("build_tiny"):
        for key in ("hidden_size", "num_layers"):
            if model.get(key) is None:
                raise ConfigError(f"model.{key}=None: model.build_tiny=true needs an integer (e.g. model=tiny)")
        # make_tiny_model uses 4 attention heads (2 KV heads); rotary embeddings need an even head size
        if model["hidden_size"] % 8:
            raise ConfigError(f"model.hidden_size={model['hidden_size']}: must be a multiple of 8 "
                              "(4 attention heads of even size)")
    return model


def check_trainer(trainer: Mapping[str, Any]) -> dict[str, Any]:
    trainer = check_mapping("trainer", trainer, TRAINER_RULES)
    check_training_sampling(trainer.get("top_p", 1.0), key="trainer.top_p")
    return trainer


def check_training_sampling(top_p: float = 1.0, top_k: Optional[int] = None, key: str = "trainer.top_p") -> None:
    """Refuse a truncated sampler (``top_p < 1`` or ``top_k > 0``) in a training run, in one line.

    Every policy loss here (ppo_clip, dis, dis_clip, vanilla; SAPO's) weights a token by pi_theta over the
    sampler's behaviour log-prob, and the trainer computes pi_theta from the full tempered softmax: under a
    truncated sampler the on-policy ratio is not 1 (vLLM records the truncated, renormalised log-prob; the hf
    engine the untruncated one, which is not what sampled the token). Evaluation may truncate (``eval.top_p``).
    """
    if top_p is not None and float(top_p) < 1.0:
        raise ConfigError(f"{key}={top_p}: training needs 1.0; the trainer's log-probs have no nucleus truncation, "
                          "so with a behaviour-log-prob loss the on-policy ratio pi_theta/mu would not be 1 (top-p is "
                          "for evaluation only)")
    if top_k is not None and int(top_k) > 0:
        key = key.replace("top_p", "top_k")
        raise ConfigError(f"{key}={top_k}: training needs top_k off (-1 or 0); the trainer's log-probs have no "
                          "top-k truncation, so with a behaviour-log-prob loss the on-policy ratio pi_theta/mu "
                          "would not be 1 (top-k is for evaluation only)")


def first_line(error: BaseException) -> str:
    """The first non-empty line of an exception's message (OmegaConf appends full_key/object_type lines)."""
    for line in str(error).splitlines():
        if line.strip():
            return line.strip()
    return type(error).__name__

