"""The command line's config, composed and checked before torch, Ray, verl or transformers load.

``python -m async_rl.train`` calls :func:`compose_command_line` first: it composes the config the way Hydra
will (same search path, ``--config-dir``, ``--config-name``, overrides) and turns each mistake into one
:class:`~async_rl.validation.ConfigError` line that names the fix, e.g.::

    algorithm=lisoa: no such option of algorithm; valid choices: grpo, li2sao, lisao, ppo, sapo (did you mean lisao?)
    trainer.checkpoint_every=10: no such key; did you mean trainer.driver.checkpoint_every? ...
    +trainer.foo=1: trainer has no key foo and + cannot add one ...

Internal config files (names starting with ``_``, such as ``algorithm/_base``) are never offered as choices.
Only ``hydra``, ``omegaconf`` and this package's light modules are imported here.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
from pathlib import Path
from typing import Any, Iterable, Optional

from omegaconf import DictConfig

from async_rl.validation import ConfigError, first_line

REPO_CONF = str(Path(__file__).resolve().parents[2] / "conf")

#: config groups whose node takes new keys added with ``+`` on the command line. None does: every setting
#: is declared in a YAML (a new env declares its own keys in its own ``conf/env/<name>.yaml``, docs/own_env.md),
#: so a mistyped ``+key`` cannot be accepted and then silently ignored.
FREE_KEY_GROUPS: tuple[str, ...] = ()

#: settings whose value is a free-form mapping that its owner checks (a reasoning-gym dataset's own config, against
#: that dataset's config class). On the command line ``KEY={...}`` (or ``KEY=null``) *replaces* the mapping, so a
#: recipe's entries for one dataset never leak into another's (Hydra alone would merge it into the recipe's mapping
#: and refuse new entries), and ``KEY.entry=value`` sets or adds one entry.
FREE_FORM_SETTINGS: tuple[str, ...] = ("env.dataset_config",)
_OVERRIDE = re.compile(r"^(\+{0,2})([A-Za-z_][\w.]*)=(.*)$", re.DOTALL)


def free_form_setting(key: str) -> Optional[str]:
    """The :data:`FREE_FORM_SETTINGS` entry ``key`` is or lies under, else None."""
    return next((name for name in FREE_FORM_SETTINGS if key == name or key.startswith(name + ".")), None)


def hydra_lines(override_line: str) -> list[str]:
    """The Hydra overrides that carry out ``override_line``: itself, but for a free-form setting's (see
    :data:`FREE_FORM_SETTINGS`): ``KEY=V`` becomes ``++KEY=null ++KEY=V`` (replace: set to null first, which works
    whether the mapping is there, null or deleted), ``KEY.entry=V`` ``++KEY.entry=V``."""
    match = _OVERRIDE.match(override_line)
    if match is None:
        return [override_line]
    key, value = match.group(2), match.group(3)
    name = free_form_setting(key)
    if name is None:
        return [override_line]
    return [f"++{name}=null", f"++{name}={value}"] if key == name else [f"++{key}={value}"]


def hydra_arguments(argv: list[str]) -> list[str]:
    """``argv`` with every override rewritten by :func:`hydra_lines` (flags and their values kept), for Hydra
    itself once :func:`compose_command_line` has accepted ``argv``."""
    out: list[str] = []
    for arg in argv:
        out.extend([arg] if arg.startswith("-") else hydra_lines(arg))
    return out


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """Hydra's own reading of ``argv`` (``--config-name``, ``--config-dir``, ``-m``, overrides, ...)."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser().parse_args(argv)


def _loader(config_dir: Optional[str], extra_paths: Iterable[str] = ()):
    """Hydra's config loader over the search path ``hydra.main`` builds: ``conf/`` (+ ``--config-dir`` first), then
    the ``hydra.searchpath`` entries of the command line (a directory of your own algorithm or env YAMLs)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery

    search_path = create_config_search_path(f"file://{REPO_CONF}")
    if config_dir is not None:
        folder = os.path.abspath(config_dir)
        if not os.path.isdir(folder):
            raise ConfigError(f"--config-dir {config_dir}: no such directory")
        search_path.prepend(provider="command-line", path=f"file://{folder}", anchor=SearchPathQuery(provider="schema"))
    for path in extra_paths:  # before the schema entry, which Hydra expects last
        if path.startswith("file://") and not os.path.isdir(path[len("file://"):]):
            raise ConfigError(f"hydra.searchpath: {path}: no such directory")
        search_path.prepend(provider="hydra.searchpath in command-line", path=path,
                            anchor=SearchPathQuery(provider="schema"))
    return ConfigLoaderImpl(config_search_path=search_path)


def _visible(names: Iterable[str]) -> list[str]:
    """Options a user may choose: internal files (``_base``) hidden, each name once, sorted."""
    return sorted({name for name in names if not name.startswith("_")})


def did_you_mean(given: str, candidates: Iterable[str]) -> Optional[str]:
    """The closest candidate to ``given``: one with the same last dotted part (a key at the wrong level), else a
    near spelling of the last part among its siblings, else a near spelling of the whole path; None when nothing
    is close."""
    # the key's own parents are no answer (trainer is not what +trainer.foo meant)
    candidates = [c for c in dict.fromkeys(candidates) if not given.startswith(f"{c}.") and c != given]
    parent, _, leaf = given.rpartition(".")
    same_leaf = [c for c in candidates if c.rpartition(".")[2] == leaf]
    if same_leaf:
        return min(same_leaf, key=lambda c: (len(c), c))
    siblings = {c.rpartition(".")[2]: c for c in candidates if c.rpartition(".")[0] == parent}
    close = [siblings[m] for m in difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.6)]
    close = close or difflib.get_close_matches(given, candidates, n=1, cutoff=0.8)
    return close[0] if close else None


def _hint(given: str, candidates: Iterable[str], shown_as=lambda c: c) -> str:
    guess = did_you_mean(given, candidates)
    return f" (did you mean {shown_as(guess)}?)" if guess else ""


def _paths(node: Any, prefix: str = "") -> list[str]:
    """Every dotted key of a config node, nested ones too (lists are leaves)."""
    out = []
    if isinstance(node, DictConfig):
        for key in node.keys():
            path = f"{prefix}{key}"
            out.append(path)
            out.extend(_paths(node._get_node(key), f"{path}."))
    return out


def _deepest_node(cfg: DictConfig, key: str) -> tuple[str, Any]:
    """The longest existing prefix of ``key`` that is a mapping, and that node."""
    parts, node, found = key.split("."), cfg, ""
    for part in parts[:-1]:
        if isinstance(node, DictConfig) and part in node.keys() and isinstance(node._get_node(part), DictConfig):
            node = node._get_node(part)
            found = f"{found}.{part}" if found else part
        else:
            break
    return found, node


def _has_key(cfg: DictConfig, key: str) -> bool:
    node: Any = cfg
    for part in key.split("."):
        # keys(), not `in node`: OmegaConf's `in` is False for a key whose value is ??? (model=local's dir)
        if not isinstance(node, DictConfig) or part not in node.keys():
            return False
        node = node._get_node(part)
    return True


def _sweep_values(override) -> list[str]:
    """The option names of a group override (each choice of a ``-m`` sweep)."""
    if not override.is_sweep_override():
        value = override.value()
        return [value] if isinstance(value, str) else []
    try:
        return [str(v) for v in override.sweep_string_iterator()]
    except Exception:  # a range or interval sweep: not option names
        return []


def compose_command_line(argv: list[str]) -> Optional[DictConfig]:
    """Compose the config of ``argv`` (the CLI's arguments after the run-directory overrides) as Hydra will,
    raising :class:`ConfigError` (one line) for an unknown config name, group option or key, a ``+`` key, or
    an override Hydra cannot parse or apply. Returns None where Hydra answers itself without a run
    (``--help``, ``--cfg``, ``--info``, shell completion) or for a ``-m`` sweep after its names are checked."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    args = parse_command_line(argv)
    if args.help or args.hydra_help or args.cfg or args.info or args.shell_completion:
        return None
    try:
        overrides = OverridesParser.create().parse_overrides(args.overrides)
    except Exception as err:  # hydra's OverrideParseException: the override's text and where it failed
        raise ConfigError(f"cannot read the command line: {first_line(err)}") from err
    extra_paths = [str(p) for o in overrides if o.key_or_group == "hydra.searchpath"
                   for p in (o.value() if isinstance(o.value(), list) else [o.value()])]
    # composing: Hydra adds hydra.searchpath itself; listing group options (the check below) needs it added here
    loader, options_loader = _loader(args.config_dir), _loader(args.config_dir, extra_paths)
    config_name = args.config_name or "config"
    primaries = _visible(options_loader.get_group_options(""))
    if config_name not in primaries and not loader.repository.config_exists(config_name):
        raise ConfigError(f"--config-name {config_name}: no such config; valid choices: {', '.join(primaries)}"
                          f"{_hint(config_name, primaries)}" + ("" if args.config_dir else
                                                              " (recipes: add --config-dir recipes)"))
    groups = [g for g in options_loader.list_groups("") if g != "hydra"]
    options = {g: _visible(options_loader.get_group_options(g)) for g in groups}

    # 1. group choices (algorithm=lisoa): the name must be one of the group's files
    group_overrides, key_overrides = [], []
    for override in overrides:
        key = override.key_or_group
        if key in options and override.package is None and not override.is_delete():
            for value in _sweep_values(override):
                if value not in options[key]:
                    raise ConfigError(f"{override.input_line}: no such option of {key}; valid choices: "
                                      f"{', '.join(options[key])}{_hint(value, options[key])}")
            group_overrides.append(override)
        else:
            key_overrides.append(override)

    def compose(chosen) -> DictConfig:
        lines = []
        for o in chosen:
            if o.is_sweep_override():  # compose with a sweep's first choice: every choice was checked above
                lines.append(f"{o.get_key_element()}={_sweep_values(o)[0]}" if _sweep_values(o) else None)
            else:
                lines.extend(hydra_lines(o.input_line))
        try:
            return loader.load_configuration(config_name, [line for line in lines if line], RunMode.RUN)
        except Exception as err:  # an interpolation or merge error Hydra reports
            raise ConfigError(first_line(err)) from err

    base = compose(group_overrides + [o for o in key_overrides if o.key_or_group.startswith("hydra.")])

    # 2. keys: each must exist in the composed config; + may not add one
    user_paths = [p for p in _paths(base) if not p.startswith("hydra")]
    for override in key_overrides:
        key = override.key_or_group
        if key.startswith("hydra.") or key == "hydra":
            continue
        free = free_form_setting(key)
        if free is not None and _has_key(base, free) and (key != free or not override.is_delete()):
            continue  # its entries are checked by its owner (the env's check), with the dataset's valid keys
        exists = _has_key(base, key)
        if override.is_add() and exists:  # Hydra: "Could not append to config. An item is already at ..."
            raise ConfigError(f"{override.input_line}: {key} exists already; set it without the +: "
                              f"{override.input_line.lstrip('+')}")
        if exists:
            continue
        parent, node = _deepest_node(base, key)
        if (override.is_add() or override.is_force_add()) and parent.split(".")[0] in FREE_KEY_GROUPS:
            continue
        keys = [k for k in node.keys()] if isinstance(node, DictConfig) else []
        where = f"keys of {parent}" if parent else "top-level keys and groups"
        if not parent:
            keys = [k for k in keys if k != "hydra"]
        listed = ", ".join(str(k) for k in keys)
        guess = _hint(key, user_paths + groups)
        if override.is_add() or override.is_force_add():
            raise ConfigError(f"{override.input_line}: {parent or 'the config'} has no key "
                              f"{key[len(parent) + 1 if parent else 0:]} and + cannot add one: no config group takes "
                              f"free keys, a new setting is declared in a YAML{guess}; {where}: {listed}")
        raise ConfigError(f"{override.input_line}: no such key{guess}; {where}: {listed}")
    if args.multirun:
        return None
    return compose(overrides)
