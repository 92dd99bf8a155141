"""Any reasoning-gym dataset as a single-turn env (``env=reasoning_gym env.dataset=<name>``), scored by the dataset.

reasoning-gym (PyPI ``reasoning-gym`` 0.1.25, Apache-2.0) has about a hundred seeded procedural generators
(``gsm_symbolic``, ``basic_arithmetic``, ``chain_sum``, ``countdown``, ...), each with its own config dataclass and its
own ``score_answer(answer, entry) -> float in [0, 1]``. This module:

- **items**: :func:`make_reasoning_gym_tasks` builds one dataset of ``num_train + num_eval`` items from
  ``(env.dataset, env.dataset_config, env.data_seed)`` and splits it by index: the first ``num_train`` are the
  training items, the rest the held-out ones, minus any whose question also occurs among the training items (small
  generators repeat questions), so the two splits never share a question. The same config gives the same items on
  any machine: the split does not depend on the run's ``seed``, which only orders the prompt stream. reasoning-gym
  seeds item ``i`` of seed ``s`` with ``s + i`` (so its seed 1 is its seed 0 moved by one item); ``data_seed`` ``d`` is
  handed over as ``d * DATA_SEED_STRIDE``, so different data seeds give different items (up to
  ``DATA_SEED_STRIDE`` items each).
- **answer extraction** (``env.answer_format``), from the model's whole response, before the dataset's scorer sees
  it:

  - ``answer_tag``: the text inside the last ``<answer>...</answer>`` (reasoning-gym's own convention:
    ``reasoning_gym.utils.extract_answer``), stripped;
  - ``hashes``: the text after the last ``####`` up to the end of that line (GSM8K's convention, and how
    ``gsm_symbolic``'s worked solutions end), stripped;
  - ``boxed``: the content of the last closed ``\\boxed{...}`` (the math grader's extractor,
    :func:`async_rl.rewards.math_reward.extract_answer`, strict).

  No match gives ``None``, which every scorer rates 0 (``invalid_action`` in the step info). When the item's
  reference answer is a plain number (``-12``, ``28080``, ``3.5``), a number written with thousands separators or a
  closing full stop (``28,080``, ``-1,234.5``, ``42.``) is passed on in that plain form (:func:`plain_number`): the
  scorers compare strings or parse with ``float`` and would rate it wrong; any other text is passed on as written.
- **reward**: exactly the dataset's ``score_answer(extracted, entry)`` (some datasets give partial credit, e.g.
  ``gsm_symbolic`` 0.01 for a number that is wrong); ``success`` means a full score (>= 1).

The task record names the item by its index; the env regenerates it from the same ``(dataset, dataset_config,
data_seed, num_train, num_eval)`` and hands the scorer the item exactly as generated: a JSON round trip of the item
would change what some scorers compare (``arc_agi`` and ``rearc`` grids are tuples: the right answer then scores 0.05
instead of 1). A record whose question does not match the regenerated item (the env built with another config) is
refused. A hand-made record may carry its item under ``entry`` instead of an index.
"""

from __future__ import annotations

import importlib.util
import random
import re
from typing import Any, Mapping, Optional

from async_rl.envs.base import Env, StepResult, register_env
from async_rl.envs.facts import Demonstrations, EnvFacts, register_env_facts

ANSWER_FORMATS = ("answer_tag", "hashes", "boxed")
#: what the prompt asks for, per answer format (appended after the dataset's question)
FORMAT_INSTRUCTIONS = {
    "answer_tag": "Think step by step, then give only the final answer between <answer> and </answer>.",
    "hashes": "Think step by step, then write the final answer on its own last line as: #### <answer>",
    "boxed": "Think step by step, then put the final answer within \\boxed{}.",
}
SPLITS = ("train", "eval")
#: reasoning-gym's seed for ``env.data_seed`` d is d * this: the item streams of two data seeds never overlap. Some
#: generators hand seed + index to numpy, which takes seeds below 2**32: so d < 4096 (MAX_DATA_SEED)
DATA_SEED_STRIDE = 1 << 20
MAX_DATA_SEED = (1 << 32) // DATA_SEED_STRIDE - 1
INSTALL_HINT = "pip install reasoning-gym==0.1.25 (a pyproject.toml dependency: make install)"

_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
_PLAIN_NUMBER = re.compile(r"[+-]?\d+(\.\d+)?")
_GROUPED_NUMBER = re.compile(r"[+-]?\d{1,3}(,\d{3})+(\.\d+)?")
_HASHES = re.compile(r"####[ \t]*([^\n]*)")


def _reasoning_gym():
    if importlib.util.find_spec("reasoning_gym") is None:
        raise ImportError(f"env=reasoning_gym needs the reasoning-gym package, which is not installed: {INSTALL_HINT}")
    import reasoning_gym

    return reasoning_gym


def dataset_names() -> list[str]:
    """Every dataset name reasoning-gym registers."""
    _reasoning_gym()  # first: a missing package gets the install hint, not a bare ModuleNotFoundError
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def create_dataset(name: str, config: Optional[Mapping[str, Any]], seed: int, size: int):
    """``reasoning_gym.create_dataset(name, seed=seed * DATA_SEED_STRIDE, size=size, **config)`` with errors that name the fix: an unknown
    name lists the valid ones, an unknown config key lists the dataset's keys."""
    import dataclasses

    rg = _reasoning_gym()
    from reasoning_gym.factory import DATASETS

    if not isinstance(name, str) or name not in DATASETS:
        raise ValueError(f"env.dataset={name!r} is not a reasoning-gym dataset; valid: {', '.join(sorted(DATASETS))}")
    config = dict(config or {})
    for key in ("seed", "size"):
        if key in config:
            raise ValueError(f"env.dataset_config.{key}: set env.data_seed / env.num_train / env.num_eval instead "
                             "(the env derives the dataset's seed and size from them)")
    config_cls = DATASETS[name][1]
    known = {f.name for f in dataclasses.fields(config_cls)} - {"seed", "size"}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"env.dataset_config has keys {unknown} that {name} does not take; valid: "
                         f"{', '.join(sorted(known))}. On the command line env.dataset_config={{...}} replaces the "
                         f"whole mapping (a recipe's, made for its own dataset, included) and env.dataset_config=null "
                         f"gives {name}'s defaults")
    if not 1 <= int(size) <= DATA_SEED_STRIDE:
        raise ValueError(f"env.num_train + env.num_eval = {size} items; at most {DATA_SEED_STRIDE} (one data seed's)")
    if isinstance(seed, bool) or not 0 <= int(seed) <= MAX_DATA_SEED:
        raise ValueError(f"env.data_seed={seed}: must be in [0, {MAX_DATA_SEED}]")
    try:
        return rg.create_dataset(name, seed=int(seed) * DATA_SEED_STRIDE, size=int(size), **config)
    except (AssertionError, TypeError, ValueError) as err:  # the dataset's own validate()
        raise ValueError(f"env.dataset_config={config} is not valid for {name}: {err or type(err).__name__}") from err


def extract_answer(text: str, answer_format: str) -> Optional[str]:
    """The answer the response gives in ``answer_format`` (module docstring), or ``None``."""
    if answer_format == "answer_tag":
        matches = _ANSWER_TAG.findall(text)
        return matches[-1].strip() if matches else None
    if answer_format == "hashes":
        matches = _HASHES.findall(text)
        answer = matches[-1].strip() if matches else ""
        return answer or None
    if answer_format == "boxed":
        from async_rl.rewards.math_reward import extract_answer as extract_last_box

        return extract_last_box(text)
    raise ValueError(f"answer_format={answer_format!r}; valid: {', '.join(ANSWER_FORMATS)}")


def plain_number(answer: Optional[str], reference: Any) -> Optional[str]:
    """``answer`` without thousands separators or a closing full stop when ``reference`` (the item's answer) is a plain
    number and what remains is one (module docstring); else ``answer`` unchanged. ``"28,080"`` -> ``"28080"``."""
    if answer is None or not _PLAIN_NUMBER.fullmatch(str(reference).strip()):
        return answer
    text = answer.strip()
    if text.endswith(".") and (_PLAIN_NUMBER.fullmatch(text[:-1]) or _GROUPED_NUMBER.fullmatch(text[:-1])):
        text = text[:-1]
    if _GROUPED_NUMBER.fullmatch(text):
        text = text.replace(",", "")
    return text if _PLAIN_NUMBER.fullmatch(text) else answer


def render_prompt(template: Optional[str], question: str, instruction: str) -> str:
    """``template`` with ``{question}`` and ``{instruction}`` filled in (plain replacement: other braces, such as
    ``\\boxed{}``, stay as written); None: the question, a blank line, the instruction."""
    template = template or "{question}\n\n{instruction}"
    return template.replace("{instruction}", instruction).replace("{question}", question)


def check_prompt_template(template: Optional[str]) -> None:
    """A template must place the question: ``{question}`` somewhere in it (None: the default)."""
    if template is not None and (not isinstance(template, str) or "{question}" not in template):
        raise ValueError(f"env.prompt_template must contain {{question}} (where the item's question goes; "
                         f"{{instruction}} places the answer format's instruction), got {template!r}; null: the "
                         "question, a blank line, the instruction")


def format_answer(answer: str, answer_format: str) -> str:
    """How a response states ``answer`` in ``answer_format`` (the inverse of :func:`extract_answer`)."""
    if answer_format == "answer_tag":
        return f"<answer>{answer}</answer>"
    if answer_format == "hashes":
        return f"#### {answer}"
    if answer_format == "boxed":
        return f"\\boxed{{{answer}}}"
    raise ValueError(f"answer_format={answer_format!r}; valid: {', '.join(ANSWER_FORMATS)}")


def make_reasoning_gym_tasks(dataset: str, dataset_config: Optional[Mapping[str, Any]] = None, data_seed: int = 0,
                             num_train: int = 1000, num_eval: int = 100, split: str = "train",
                             prompt_template: Optional[str] = None, answer_format: str = "answer_tag",
                             ) -> list[dict[str, Any]]:
    """The ``split`` items (``train`` or ``eval``) as task records ``{id, prompt, answer, question, index}``.

    ``prompt`` is ``prompt_template`` with ``{question}`` and ``{instruction}`` filled in (:func:`render_prompt`;
    default: the question, a blank line, the answer format's instruction). Disjoint splits: see the module docstring.
    """
    check_prompt_template(prompt_template)
    if split not in SPLITS:
        raise ValueError(f"env.split={split!r}; valid: {', '.join(SPLITS)}")
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"env.answer_format={answer_format!r}; valid: {', '.join(ANSWER_FORMATS)}")
    if int(num_train) < 1 or int(num_eval) < 0:
        raise ValueError(f"env.num_train={num_train} must be >= 1 and env.num_eval={num_eval} >= 0")
    data = create_dataset(dataset, dataset_config, data_seed, dataset_size(num_train, num_eval))
    items = [data[i] for i in range(int(num_train) + int(num_eval))]
    train_questions = {item["question"] for item in items[:num_train]}
    if split == "train":
        chosen = list(enumerate(items[:num_train]))
    else:
        chosen = [(i, item) for i, item in enumerate(items) if i >= num_train
                  and item["question"] not in train_questions]
    instruction = FORMAT_INSTRUCTIONS[answer_format]
    tasks = []
    for index, item in chosen:
        tasks.append({"id": f"{dataset}-{data_seed}-{index}",
                      "prompt": render_prompt(prompt_template, item["question"], instruction),
                      "answer": str(item["answer"]),
            "question": item["question"], "index": index})
    return tasks


def dataset_size(num_train: int, num_eval: int) -> int:
    """The size the items are generated with (some generators draw per-item choices for the whole size at once)."""
    return int(num_train) + max(int(num_eval), 1)


@register_env("reasoning_gym")
class ReasoningGymEnv(Env):
    """One question, one answer, rewarded by the reasoning-gym dataset's own scorer (module docstring).

    Args:
        dataset: a reasoning-gym dataset name (``env.dataset``).
        dataset_config: that dataset's config keys (``env.dataset_config``); some scorers read them.
        answer_format: how the answer is read from the response: ``answer_tag``, ``hashes`` or ``boxed``.
        data_seed, num_train, num_eval: as the tasks were made (``env.data_seed``, ...): the env regenerates a
            record's item by its ``index`` from them.

    ``step`` info: ``extracted_answer`` (str | None), ``score`` (the scorer's float), ``success`` (score >= 1),
    ``invalid_action`` (no answer in the requested format).
    """

    max_turns = 1

    def __init__(self, dataset: str = "gsm_symbolic", dataset_config: Optional[Mapping[str, Any]] = None,
                 answer_format: str = "answer_tag", data_seed: int = 0, num_train: int = 1000,
                 num_eval: int = 100) -> None:
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format={answer_format!r}; valid: {', '.join(ANSWER_FORMATS)}")
        self.dataset_name = dataset
        self.answer_format = answer_format
        self.num_items = int(num_train) + int(num_eval)
        self._data = create_dataset(dataset, dataset_config, data_seed, dataset_size(num_train, num_eval))
        self._entry: Optional[Mapping[str, Any]] = None
        self._done = True

    def item(self, task: Mapping[str, Any]) -> Mapping[str, Any]:
        """The generated item a task record stands for (regenerated by ``index``; a hand-made ``entry`` as is)."""
        index = task.get("index")
        if index is not None:
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.num_items:
                raise ValueError(f"reasoning_gym task {task.get('id', '?')!r}: index {index!r} is not an item of "
                                 f"this env's {self.dataset_name} data (0..{self.num_items - 1})")
            item = self._data[index]
            if "question" in task and task["question"] != item["question"]:
                raise ValueError(f"reasoning_gym task {task.get('id', '?')!r} was made with another dataset config "
                                 f"or seed than this env's ({self.dataset_name}): build the env from the same env "
                                 "config as the tasks (dataset, dataset_config, data_seed, num_train, num_eval)")
            return item
        entry = task.get("entry")
        if isinstance(entry, Mapping) and "answer" in entry:
            return entry
        raise KeyError(f"reasoning_gym task {task.get('id', '?')!r} needs an 'index' into the generated items (or "
                       f"the item under 'entry'); fields: {sorted(task)}. Build tasks with make_reasoning_gym_tasks")

    def reset(self, task: dict[str, Any]) -> str:
        if not isinstance(task.get("prompt"), str):
            raise KeyError(f"reasoning_gym task {task.get('id', '?')!r} needs a 'prompt' text; fields: {sorted(task)}")
        self._entry = self.item(task)
        self._done = False
        return task["prompt"]

    def step(self, action_text: str) -> StepResult:
        if self._entry is None:
            raise RuntimeError("ReasoningGymEnv.step called before reset")
        if self._done:
            raise RuntimeError("ReasoningGymEnv episode is over (single turn); call reset for the next task")
        self._done = True
        answer = plain_number(extract_answer(action_text, self.answer_format), self._entry.get("answer"))
        score = float(self._data.score_answer(answer, self._entry))
        if not score == score or not 0.0 <= score <= 1.0:  # a scorer out of its documented range: clamp, never NaN
            score = 0.0 if score != score else min(max(score, 0.0), 1.0)
        return StepResult(observation="", reward=score, done=True,
                          info={"extracted_answer": answer, "score": score, "success": score >= 1.0,
                                "invalid_action": answer is None})


def reasoning_gym_env_kwargs(env_cfg: Any) -> dict[str, Any]:
    config = _to_plain(env_cfg.get("dataset_config"))  # nested lists too (operators: [...]) as plain values
    return {"dataset": env_cfg.get("dataset"), "dataset_config": dict(config or {}),
            "answer_format": env_cfg.get("answer_format") or "answer_tag", "data_seed": int(env_cfg.get("data_seed") or 0),
            "num_train": int(env_cfg.get("num_train")), "num_eval": int(env_cfg.get("num_eval"))}


def _to_plain(value: Any) -> Any:
    try:  # an OmegaConf node (the Hydra config) -> plain dict
        from omegaconf import OmegaConf

        if OmegaConf.is_config(value):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    return value


def _tasks_from_config(env_cfg: Any, seed: int) -> list[dict[str, Any]]:
    """The prompt stream's records: ``env.split``'s items (train unless eval asks otherwise), ordered by ``seed``
    (training) so runs with different seeds see the same items in different orders."""
    split = env_cfg.get("split") or "train"
    tasks = make_reasoning_gym_tasks(
        env_cfg.get("dataset"), _to_plain(env_cfg.get("dataset_config")), int(env_cfg.get("data_seed") or 0),
        int(env_cfg.get("num_train")), int(env_cfg.get("num_eval")), split=split,
        prompt_template=env_cfg.get("prompt_template"), answer_format=env_cfg.get("answer_format") or "answer_tag")
    if split == "eval" and env_cfg.get("num_tasks"):  # make eval limit=N
        tasks = tasks[:int(env_cfg.get("num_tasks"))]
    if split == "train":
        random.Random(seed).shuffle(tasks)
    return tasks


def _worked_solution_policy(env, task: dict[str, Any], noisy: bool, rng: random.Random, **_: Any):
    """SFT warm start: the item's worked solution when the dataset ships one (``metadata.answer_cot``, e.g.
    gsm_symbolic; its final ``#### N`` line is restated in the env's answer format), else the bare answer. A noisy
    demonstration states a wrong final answer (one digit changed, or a different string)."""
    from async_rl.envs.demonstrations import _wrong_number

    entry = env.item(task)
    answer = str(entry["answer"]).strip()
    stated = _wrong_number(rng, answer) if noisy else answer
    if noisy and stated == answer:
        stated = answer + "0"
    cot = str((entry.get("metadata") or {}).get("answer_cot") or "").strip()
    cot = _HASHES.sub("", cot).rstrip()  # its own final line goes; the answer is restated below
    text = (cot + "\n" if cot else "") + format_answer(stated, env.answer_format)

    def act(observation: str) -> str:
        return text

    return act


REASONING_GYM_DEMONSTRATIONS = Demonstrations(
    policy=_worked_solution_policy, think_fillers=False,
    task_settings=("dataset", "dataset_config", "data_seed", "num_train", "num_eval", "answer_format",
                   "prompt_template"),
    sft_defaults={"noise": 0.5, "steps": 60, "clean_fraction": 0.5, "num_demos": 128, "batch_size": 4})

def _check_config(env_cfg: Any) -> None:
    """Before any model loads: the dataset name, its config keys and the prompt template (builds a one-item
    dataset)."""
    check_prompt_template(env_cfg.get("prompt_template"))
    create_dataset(env_cfg.get("dataset"), _to_plain(env_cfg.get("dataset_config")),
                   int(env_cfg.get("data_seed") or 0), 1)


register_env_facts("reasoning_gym", EnvFacts(make_tasks=_tasks_from_config, env_kwargs=reasoning_gym_env_kwargs,
                                             eval_split="eval", demonstrations=REASONING_GYM_DEMONSTRATIONS,
                                             check_config=_check_config))
