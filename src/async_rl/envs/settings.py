"""``env.*`` of the config: one settings class per built-in env (``conf/env/<name>.yaml`` mirrors it field for field
and value for value; tests/test_settings.py checks both), each field with its type, default, range and meaning.

:func:`check_env` checks a config group against the class of its ``env.name`` (:data:`ENV_SETTINGS`); an env of an
outside module (``env.module``) is checked on the keys every env has (:class:`EnvSettings`), its own keys are its
module's. Plain Python: the CLI runs this before torch loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from async_rl.validation import ConfigError, Rule, check_mapping, check_settings, setting, settings_as_dict, \
    settings_from_mapping

#: the ReTool instruction around the question (envs/retool.py shows it; here so the settings import no env code)
RETOOL_PROMPT_TEMPLATE = (
    "Solve the following problem step by step. You can run Python code: write it inside <code>...</code> "
    "and the output of the code will be shown to you inside <interpreter>...</interpreter>. Use print() to "
    "see values. When you are done, give the final answer inside \\boxed{} in a message without code.\n\n"
    "{prompt}"
)

TASK_ENVS = ("toy_keys", "toy_echo", "math", "retool", "webshop", "alfworld", "reasoning_gym")
ALFWORLD_SPLITS = ("train", "valid_seen", "valid_unseen", "eval_in_distribution", "eval_out_of_distribution")
WEBSHOP_SPLITS = ("train", "test", "all")
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass
class EnvSettings:
    """The keys every env has: its name and the episode's limits."""

    name: str = setting(meaning="the env: a built-in one or one an env.module registers", non_empty=True)
    module: Optional[str] = setting(None, "an importable module outside this package that registers env.name when "
                                          "imported (docs/own_env.md); null: a built-in env", non_empty=True)
    max_turns: int = setting(1, "env turns per episode (the env's own max_turns also applies)", range=">= 1")
    max_new_tokens: int = setting(256, "tokens the model may write in one turn", range=">= 1")
    max_response_tokens: int = setting(256, "model + observation tokens of an episode after the prompt",
                                       range=">= 1")
    env_timeout_s: float = setting(30.0, "any env call (construct, reset, step, close) slower than this aborts the "
                                         "episode", range="> 0")
    stop_strings: Optional[list[str]] = setting(None, "end a model turn when its text contains one (e.g. </code>); "
                                                      "null: none")


@dataclass
class ToyKeysSettings(EnvSettings):
    name: str = setting("toy_keys", "toy_keys: look at a hidden key, then use it (docs/toy_tasks.md)",
                        choices=("toy_keys",))
    num_tasks: int = setting(512, "tasks generated for the prompt stream", range=">= 1")
    max_turns: int = setting(4, "env turns per episode", range=">= 1")
    max_new_tokens: int = setting(24, "tokens the model may write in one turn", range=">= 1")
    max_response_tokens: int = setting(160, "model + observation tokens of an episode after the prompt",
                                       range=">= 1")


@dataclass
class ToyEchoSettings(EnvSettings):
    name: str = setting("toy_echo", "toy_echo: repeat a word (docs/toy_tasks.md)", choices=("toy_echo",))
    num_tasks: int = setting(512, "tasks generated for the prompt stream", range=">= 1")
    max_new_tokens: int = setting(32, "tokens the model may write in one turn", range=">= 1")
    max_response_tokens: int = setting(32, "model tokens of an episode after the prompt", range=">= 1")


@dataclass
class MathSettings(EnvSettings):
    """Math with a verifiable answer (DAPO-Math training, AIME evaluation); the data loader's keys."""

    name: str = setting("math", "math: one answer per problem, graded by the math reward", choices=("math",))
    train_data: str = setting("data/dapo-math-17k/dapo-math-17k.parquet", "training problems: a parquet/jsonl "
                              "file, a directory, or a hub name with allow_hub=true", non_empty=True)
    train_split: str = setting("train", "the split of a hub dataset", non_empty=True)
    eval_sets: Optional[list] = setting(["data/aime/aime_2024.jsonl", "data/aime/aime_2025.jsonl",
                                         "data/aime/aime_2026.jsonl"],
                                        "files, directories or {path, name, year} mappings `make eval` scores")
    num_tasks: Optional[int] = setting(None, "first N training problems; null: all", range=">= 1")
    prompt_key: Optional[str] = setting(None, "the problem's column; null: detected (prompt, problem, question)")
    answer_key: Optional[str] = setting(None, "the answer's column; null: detected (answer, solution, ...)")
    id_key: Optional[str] = setting(None, "the id column; null: detected, else the row number")
    strip_dapo_instruction: bool = setting(True, "drop DAPO-Math's own answer instruction from its prompts")
    prompt_template: Optional[str] = setting(
        "{question}\n\nPlease reason step by step, and put your final answer within \\boxed{}.",
        "the user message around {question}; null: the question alone")
    dedupe: bool = setting(True, "drop repeated problems")
    allow_hub: bool = setting(False, "train_data may name a Hugging Face hub dataset (needs network)")
    cache_dir: Optional[str] = setting(None, "where hub datasets are cached; null: the datasets default")
    max_new_tokens: int = setting(8192, "tokens the model may write in one turn", range=">= 1")
    max_response_tokens: int = setting(8192, "tokens of an episode after the prompt", range=">= 1")
    verify_timeout_s: float = setting(5.0, "seconds the answer grader may take", range="> 0")
    fallback_last_number: bool = setting(False, "grade the response's last number when it has no \\boxed{} answer "
                                                "(off in every recipe)")


@dataclass
class SandboxSettings:
    """``env.sandbox.*``: which sandbox runs the model's code, and its options (null: the sandbox's own default;
    async_rl.sandbox.LocalSandbox / SandboxFusionClient)."""

    kind: str = setting("local", "local: our sandbox (docs/sandbox.md) | fusion: a SandboxFusion server",
                        choices=("local", "fusion"))
    url: Optional[str] = setting("http://localhost:8080", "the SandboxFusion server of kind=fusion")
    timeout_s: Optional[float] = setting(None, "a code run's default time limit (env.code_timeout_s sets each run's)",
                                         range="> 0")
    memory_limit_mb: Optional[int] = setting(None, "memory limit of a code run, MiB", range=">= 1")
    max_output_bytes: Optional[int] = setting(None, "stdout/stderr bytes kept per run", range=">= 1")
    max_concurrency: Optional[int] = setting(None, "code runs at once", range=">= 1")
    process_memory_mb: Optional[int] = setting(None, "local: address space of each process, MiB", range=">= 1")
    cpu_time_limit_s: Optional[int] = setting(None, "local: CPU seconds of a run (null: from the time limit)",
                                              range=">= 1")
    max_processes: Optional[int] = setting(None, "local: processes a run may have", range=">= 1")
    strict: Optional[bool] = setting(None, "local: refuse to run when a confinement layer is unavailable")
    max_retries: Optional[int] = setting(None, "fusion: retries of a failed request", range=">= 0")
    request_overhead_s: Optional[float] = setting(None, "fusion: seconds added to a run's limit for the request",
                                                  range=">= 0")


#: the sandbox options only one kind takes (the other's constructor would refuse them)
SANDBOX_ONLY = {"local": ("process_memory_mb", "cpu_time_limit_s", "max_processes", "strict"),
                "fusion": ("max_retries", "request_overhead_s")}


@dataclass
class ReToolSettings(MathSettings):
    """Math with a Python tool in a sandbox (ReTool)."""

    name: str = setting("retool", "retool: math with a Python tool run in a sandbox", choices=("retool",))
    train_data: str = setting("toy", "training problems (as math), or toy: the embedded arithmetic tasks",
                              non_empty=True)
    num_tasks: Optional[int] = setting(512, "first N training problems (toy: tasks generated); null: all",
                                       range=">= 1")
    prompt_template: Optional[str] = setting(None, "the user message around {question}; null: the tool prompt's")
    max_turns: int = setting(8, "model turns (each may run code) per episode", range=">= 1")
    max_new_tokens: int = setting(4096, "tokens the model may write in one turn", range=">= 1")
    max_response_tokens: int = setting(16384, "model + tool-output tokens of an episode", range=">= 1")
    stop_strings: Optional[list[str]] = setting(["</code>"], "end a model turn at the end of a code block")
    env_timeout_s: float = setting(60.0, "any env call slower than this aborts the episode (above code_timeout_s)",
                                   range="> 0")
    code_timeout_s: float = setting(10.0, "seconds one code run may take (a timeout is shown to the model)",
                                    range="> 0")
    tool_prompt_template: Optional[str] = setting(RETOOL_PROMPT_TEMPLATE, "the ReTool instruction around the "
                                                  "question ({prompt}); null: the question as is")
    max_observation_chars: int = setting(2048, "characters of a code run's output shown (a head and a tail)",
                                         range=">= 16")
    persist_state: bool = setting(False, "keep Python variables from one code run to the next")
    sandbox: SandboxSettings = setting(SandboxSettings(), "where code runs")


@dataclass
class WebShopSettings(EnvSettings):
    name: str = setting("webshop", "webshop: find and buy a product matching an instruction", choices=("webshop",))
    backend: str = setting("simulator", "simulator: our synthetic shop in process | server: a WebShop server",
                           choices=("simulator", "server"))
    server_url: str = setting("http://127.0.0.1:3000", "the WebShop server of backend=server", non_empty=True)
    server_timeout_s: float = setting(20.0, "seconds a server request may take", range="> 0")
    num_tasks: int = setting(512, "goals in the prompt stream", range=">= 1")
    split: str = setting("train", "goals trained on", choices=WEBSHOP_SPLITS)
    max_turns: int = setting(15, "actions per episode", range=">= 1")
    history_length: int = setting(2, "earlier observations kept in the prompt", range=">= 0")
    max_new_tokens: int = setting(512, "tokens the model may write in one turn", range=">= 1")
    max_response_tokens: int = setting(16384, "model + page tokens of an episode", range=">= 1")
    catalog_seed: int = setting(0, "seed of the synthetic catalog", range=">= 0")
    num_products: int = setting(500, "products in the synthetic catalog", range=">= 1")
    num_goals: int = setting(2000, "goals generated", range=">= 1")
    num_test_goals: int = setting(200, "goals held out for evaluation", range=">= 0")
    page_size: int = setting(10, "search results per page", range=">= 1")
    goal_range: Optional[list[int]] = setting(None, "[start, stop) of the goals used; null: the split's")
    check_instruction: bool = setting(True, "refuse a goal whose instruction cannot be met by the catalog")
    eval_split: str = setting("test", "goals `make eval` plays", choices=WEBSHOP_SPLITS)


@dataclass
class ReasoningGymSettings(EnvSettings):
    """Any reasoning-gym dataset, scored by its own scorer (envs/reasoning_gym_env.py, docs/tasks.md)."""

    name: str = setting("reasoning_gym", "reasoning_gym: a procedural dataset of the reasoning-gym package",
                        choices=("reasoning_gym",))
    dataset: str = setting("gsm_symbolic", "the dataset's name (checked against the package)", non_empty=True)
    dataset_config: Optional[dict] = setting({}, "the dataset's own settings, e.g. {max_digits: 1}")
    data_seed: int = setting(0, "seed of the generated items (each seed its own items)", range="[0, 4095]")
    num_train: int = setting(1000, "training items", range=">= 1")
    num_eval: int = setting(100, "held-out items (disjoint from the training ones)", range=">= 0")
    split: str = setting("train", "the items trained on", choices=("train", "eval"))
    eval_split: str = setting("eval", "the items `make eval` scores", choices=("eval",))
    num_tasks: Optional[int] = setting(None, "first N items of the split; null: all", range=">= 1")
    answer_format: str = setting("answer_tag", "how the answer is written: <answer>N</answer> | #### N | \\boxed{N}",
                                 choices=("answer_tag", "hashes", "boxed"))
    prompt_template: Optional[str] = setting(None, "the user message around {question}; null: ours for the "
                                                   "answer format")


@dataclass
class AlfWorldSettings(EnvSettings):
    name: str = setting("alfworld", "alfworld: text household tasks (the alfworld package)", choices=("alfworld",))
    data_dir: str = setting("~/.cache/alfworld", "the ALFWorld data (ALFWORLD_DATA)", non_empty=True)
    split: str = setting("train", "the games trained on", choices=ALFWORLD_SPLITS)
    num_tasks: int = setting(0, "games in the prompt stream; 0 = every game of the split", range=">= 0")
    max_turns: int = setting(50, "actions per episode", range=">= 1")
    history_length: int = setting(2, "earlier observations kept in the prompt", range=">= 0")
    max_new_tokens: int = setting(512, "tokens the model may write in one turn", range=">= 1")
    max_response_tokens: int = setting(32768, "model + observation tokens of an episode", range=">= 1")
    env_timeout_s: float = setting(120.0, "any env call slower than this aborts the episode", range="> 0")
    eval_split: str = setting("eval_out_of_distribution", "the games `make eval` plays", choices=ALFWORLD_SPLITS)
    categories: Optional[list[str]] = setting(None, "task types played (e.g. [pick_and_place_simple]); null: all")


#: the settings class of each built-in env (conf/env/<name>.yaml mirrors it); an env of an outside module is checked
#: on the keys every env has (EnvSettings): its module is not imported before the run starts
ENV_SETTINGS: dict[str, type] = {
    "toy_keys": ToyKeysSettings, "toy_echo": ToyEchoSettings, "math": MathSettings, "retool": ReToolSettings,
    "webshop": WebShopSettings, "reasoning_gym": ReasoningGymSettings, "alfworld": AlfWorldSettings,
}


def env_settings(env: Mapping[str, Any]) -> EnvSettings:
    """The settings instance of an ``env`` group that :func:`check_env` passed (an outside env's own keys left
    out: its module reads them from the group)."""
    return settings_from_mapping(ENV_SETTINGS.get(env.get("name"), EnvSettings), env, "env", keep_unknown=True)[0]


def check_env(env: Mapping[str, Any]) -> dict[str, Any]:
    """Checked copy of the ``env`` group (ints given for floats become floats): every key of its ``env.name``'s
    settings class, and the cross-key rules. An env of an outside module (``env.module``) may have any name and
    keys of its own; the keys every env has are checked."""
    if not isinstance(env, Mapping):
        raise ConfigError(f"env={env!r}: must be a config group (choose env=<{'|'.join(TASK_ENVS)}>)")
    module = check_mapping("env", env, {"module": Rule("str", optional=True, non_empty=True)}).get("module")
    if module is not None and not _MODULE_NAME.match(module):
        raise ConfigError(f"env.module={module!r}: must be an importable module name such as my_pkg.my_env")
    name = env.get("name")
    if name is None:
        raise ConfigError(f"env.name is missing: choose env=<{'|'.join(TASK_ENVS)}>")
    cls = ENV_SETTINGS.get(name) if isinstance(name, str) else None
    if cls is None and not module:
        raise ConfigError(f"env.name={name!r}: must be one of {', '.join(ENV_SETTINGS)} (an env of your own: set "
                          "env.module, docs/own_env.md)")
    for key in ("max_turns", "max_new_tokens", "max_response_tokens", "env_timeout_s"):
        if key not in env:
            raise ConfigError(f"env.{key} is missing: set it in the env's YAML (env/{name}.yaml)")
    settings, own_keys = settings_from_mapping(cls or EnvSettings, env, "env", keep_unknown=True)
    if cls is not None and own_keys:
        raise ConfigError(f"env.{sorted(own_keys)[0]} is not a setting of env={name}; valid keys: "
                          f"{', '.join(f for f in settings_as_dict(settings))}")
    check_settings(settings, "env")
    # an outside env's own keys are its module's to check, but a timeout is held to what its name promises
    own = check_mapping("env", own_keys, {key: Rule("float", "> 0") for key in own_keys if key.endswith("_timeout_s")})
    checked = {**{key: value for key, value in settings_as_dict(settings).items() if key in env}, **own}
    code_timeout = checked.get("code_timeout_s")
    if code_timeout is not None and checked["env_timeout_s"] <= code_timeout:
        raise ConfigError(f"env.env_timeout_s={checked['env_timeout_s']}: must exceed env.code_timeout_s="
                          f"{code_timeout} (a code run that times out is shown to the model, not aborted)")
    sandbox = checked.get("sandbox")
    if isinstance(sandbox, Mapping):
        for kind, keys in SANDBOX_ONLY.items():
            given = [key for key in keys if sandbox.get(key) is not None]
            if given and sandbox.get("kind") != kind:
                raise ConfigError(f"env.sandbox.{given[0]}={sandbox[given[0]]!r} is an option of "
                                  f"env.sandbox.kind={kind} only (this run: {sandbox.get('kind')}); set it to null")
    goal_range = checked.get("goal_range")
    if goal_range is not None and (len(goal_range) != 2 or not 0 <= goal_range[0] < goal_range[1]):
        raise ConfigError(f"env.goal_range={goal_range}: must be [start, stop) with 0 <= start < stop")
    return checked
