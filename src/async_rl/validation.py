"""Type and range checks of every config value, run before any model loads (issue 13, item 7; issue 35, item 4).

Every config group and every command-line tool's options is a settings dataclass whose fields are
:func:`setting` fields: type (the annotation), default, range or choices, and a one-line meaning. Every check of a single
value is derived from them here (:func:`check_settings`, :func:`parse_settings` for argparse tools); a class's own
``validate`` / ``check_*`` adds only the rules that combine fields. A bad value raises :class:`ConfigError` with one
line that names the key as the user types it on the command line, the value and what is allowed, e.g.::

    trainer.driver.total_steps='abc': must be an integer >= 1

The CLI (``async_rl.train``) prints such errors as ``error: <message>`` and exits with status 2.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional


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
# settings dataclasses: every field carries its type (annotation), default, range or choices and meaning
# (metadata written by setting()); every check of a single value is derived from them, here
# ----------------------------------------------------------------------------------------------------------
def setting(default: Any = dataclasses.MISSING, meaning: str = "", *, range: Optional[str] = None,
            choices: Optional[tuple] = None, non_empty: bool = False) -> Any:
    """A settings field: ``default`` (a list or dict default is copied per instance; none = required), ``meaning``
    (one line, shown by ``--help`` and the docs), ``range`` (numbers, :func:`parse_range` text) or ``choices``
    (the allowed values) and ``non_empty`` (strings, lists). :func:`check_settings` reads them::

        total_steps: int = setting(100, "optimizer batches to train", range=">= 1")
    """
    if range is not None:
        parse_range(range)  # a typo in a range fails at import, not at the first bad value
    metadata = {"meaning": meaning, "range": range, "choices": tuple(choices) if choices is not None else None,
                "non_empty": non_empty}
    if isinstance(default, (list, dict)) or (dataclasses.is_dataclass(default) and not isinstance(default, type)):
        frozen = copy.deepcopy(default)
        return dataclasses.field(default_factory=lambda: copy.deepcopy(frozen), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


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


def field_rule(f: dataclasses.Field, annotation: Any) -> tuple[Optional[Rule], Optional[type]]:
    """The :class:`Rule` of one settings field (type from ``annotation``, the rest from :func:`setting`'s
    metadata), and its nested settings class when it is one."""
    rule, nested = _rule_for_annotation(annotation)
    if rule is None or nested is not None:
        return rule, nested
    meta = f.metadata
    return dataclasses.replace(rule, range=meta.get("range") if rule.kind in ("int", "float") else None,
                               choices=meta.get("choices") or rule.choices,
                               non_empty=bool(meta.get("non_empty"))), None


def settings_fields(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field, Optional[Rule]]]:
    """``(dotted name, field, rule)`` for every field of the settings class ``cls`` and of its nested settings
    classes (a nested class's own fields follow its name)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        rule, nested = field_rule(f, hints[f.name])
        out.append((prefix + f.name, f, rule))
        if nested is not None:
            out.extend(settings_fields(nested, f"{prefix}{f.name}."))
    return out


def field_default(f: dataclasses.Field) -> Any:
    """A field's default value (a fresh one for a default factory); ``dataclasses.MISSING`` for a required one."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def check_settings(obj: Any, prefix: str) -> Any:
    """Check (and normalise in place: int -> float for a float field, 1e3 -> 1000 for an int field) every field of
    the settings instance ``obj`` and of its nested settings, by the rules :func:`field_rule` derives. ``prefix``
    is the config group as typed on the command line (``trainer.driver``). Returns ``obj``."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        rule, nested = field_rule(f, hints[f.name])
        value = getattr(obj, f.name)
        key = f"{prefix}.{f.name}" if prefix else f.name
        if nested is not None:
            if value is None and rule.optional:
                continue
            if not isinstance(value, nested):
                raise ConfigError(f"{key}={_show(value)}: must be a mapping of "
                                  f"{', '.join(g.name for g in dataclasses.fields(nested))}")
            check_settings(value, key)
            continue
        if rule is not None:
            setattr(obj, f.name, check_value(key, value, rule))
    return obj


def settings_from_mapping(cls: type, values: Any, prefix: str, keep_unknown: bool = False) -> Any:
    """Build the settings class ``cls`` from a plain mapping (nested settings from nested mappings). An unknown key
    fails with the valid ones (``keep_unknown``: they are returned instead, as ``(settings, {key: value})``), a
    missing required key names itself. Values are not checked: :func:`check_settings` does that."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"{prefix}={_show(values)}: must be a mapping with keys "
                          f"{', '.join(f.name for f in dataclasses.fields(cls))}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown and not keep_unknown:
        raise ConfigError(f"unknown {cls.__name__} keys {unknown} under {prefix}; valid keys: {sorted(known)}")
    missing = [name for name, f in known.items() if name not in values and field_default(f) is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{prefix}.{missing[0]} is missing: it has no default; set it")
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            continue
        _, nested = _rule_for_annotation(hints[key])
        kwargs[key] = settings_from_mapping(nested, value, f"{prefix}.{key}") \
            if nested is not None and isinstance(value, Mapping) else value
    built = cls(**kwargs)
    return (built, {k: values[k] for k in unknown}) if keep_unknown else built


def settings_as_dict(obj: Any) -> dict[str, Any]:
    """The plain mapping of a settings instance (nested settings as mappings): what its YAML group holds."""
    return dataclasses.asdict(obj)


def fill_from(cls: type, *sources: Any, **given: Any) -> Any:
    """An instance of the dataclass ``cls`` whose fields come from the same-named fields of ``sources`` (settings
    instances, first one holding the name wins), ``given`` keywords first. A field none of them holds keeps its
    default; so no settings object copies another's fields by hand, and a field added to both is carried at once."""
    kwargs = dict(given)
    for f in dataclasses.fields(cls):
        if f.name in kwargs or not f.init:
            continue
        for source in sources:
            if dataclasses.is_dataclass(source) and f.name in {g.name for g in dataclasses.fields(source)}:
                kwargs[f.name] = getattr(source, f.name)
                break
    return cls(**kwargs)


# ----------------------------------------------------------------------------------------------------------
# command-line tools: options of a settings class as --flags (argparse), read back into the class and checked
# ----------------------------------------------------------------------------------------------------------
def describe_setting(f: dataclasses.Field, rule: Optional[Rule]) -> str:
    """``meaning [allowed; default: x]`` of one field, for ``--help`` and usage texts."""
    default = field_default(f)
    parts = [f.metadata.get("meaning", "")]
    if rule is not None and (rule.range or rule.choices):
        parts.append(f"[{rule.describe()}]")
    if default is not dataclasses.MISSING:
        parts.append(f"(default: {default!r})")
    else:
        parts.append("(required)")
    return " ".join(p for p in parts if p)


def add_settings_arguments(parser: Any, cls: type, positional: tuple[str, ...] = ()) -> None:
    """One ``--field-name`` option per field of the settings class ``cls`` (``positional``: fields taken as
    positional arguments instead): type, default, choices and help text all from the field. A list field takes
    several values; a bool field takes ``--name`` / ``--no-name``."""
    import argparse

    for name, f, rule in settings_fields(cls):
        if "." in name:
            raise TypeError(f"{cls.__name__}.{name}: nested settings are not command-line options")
        help_text = describe_setting(f, rule).replace("%", "%%")
        default = field_default(f)
        kwargs: dict[str, Any] = {"help": help_text}
        if rule is not None and rule.kind == "bool":
            kwargs.update(action=argparse.BooleanOptionalAction, default=default)
        elif rule is not None and rule.kind == "list":
            kwargs.update(nargs="*", default=default, type=_ITEM_TYPES.get(rule.items or "str", str))
        else:
            kwargs.update(type=_parse_optional(_ITEM_TYPES.get(rule.kind, str) if rule else str, rule))
            if rule is not None and rule.choices is not None and not rule.optional:
                kwargs["choices"] = rule.choices  # an optional one's choices (and none) are check_value's
        if name in positional:
            kwargs.pop("default", None) if default is dataclasses.MISSING else kwargs.setdefault("nargs", "?")
            if default is not dataclasses.MISSING:
                kwargs["default"] = default
            parser.add_argument(name, **kwargs)
            continue
        if default is dataclasses.MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        parser.add_argument("--" + name.replace("_", "-"), dest=name, **kwargs)


_ITEM_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _parse_optional(convert: Callable[[str], Any], rule: Optional[Rule]) -> Callable[[str], Any]:
    """argparse's ``type``: ``none``/``null`` is None for an optional number or choice (a free-text option keeps the
    word: ``--out none`` is a folder named none), else ``convert``."""
    takes_none = rule is not None and rule.optional and (rule.kind != "str" or rule.choices is not None)

    def parse(text: str) -> Any:
        if takes_none and text.strip().lower() in ("none", "null"):
            return None
        return convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")  # argparse names the type in its errors
    return parse


def settings_from_arguments(cls: type, namespace: Any, prefix: str = "--") -> Any:
    """The settings instance from an argparse namespace of :func:`add_settings_arguments`, checked (an error names
    the option as typed, e.g. ``--steps=0: must be an integer >= 1``)."""
    values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)}
    built = cls(**values)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        rule, _ = field_rule(f, hints[f.name])
        if rule is not None:
            setattr(built, f.name, check_value(prefix + f.name.replace("_", "-"), getattr(built, f.name), rule))
    return built


def parse_settings(cls: type, argv: Optional[list[str]] = None, description: str = "",
                   positional: tuple[str, ...] = (), prog: Optional[str] = None) -> Any:
    """argparse over the settings class ``cls``: ``--help`` lists every field with its meaning, allowed values and
    default; a bad value exits with status 2 and one line naming the option (as argparse does)."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_settings_arguments(parser, cls, positional)
    namespace = parser.parse_args(argv)
    try:
        return settings_from_arguments(cls, namespace)
    except ConfigError as err:
        parser.error(str(err))


# ----------------------------------------------------------------------------------------------------------
# checks that need more than one value, or the machine (the settings classes of each group call them)
# ----------------------------------------------------------------------------------------------------------
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

