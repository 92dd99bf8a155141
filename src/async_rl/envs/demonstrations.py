"""Scripted demonstrations for the supervised warm start, one policy per env, registered with the env's facts.

A policy is built per episode, ``policy(env, task, noisy, rng, **options)``, and returns ``act(observation) ->
action text``. Clean episodes play the task's expert; a noisy one makes one mistake, so that a model trained on
them succeeds only sometimes. ``models/sft.py`` plays them through the real env. Details: docs/toy_tasks.md
(warm start), recipes/README.md (the tiny recipes' warm starts).
"""

from __future__ import annotations

import random
import re
from typing import Any, Callable

from async_rl.envs.facts import Demonstrations

Act = Callable[[str], str]

__all__ = [
    "ALFWORLD_DEMONSTRATIONS",
    "MATH_DEMONSTRATIONS",
    "RETOOL_DEMONSTRATIONS",
    "TOY_ECHO_DEMONSTRATIONS",
    "TOY_KEYS_DEMONSTRATIONS",
    "WEBSHOP_DEMONSTRATIONS",
    "names_phrase",
]


# ----------------------------------------------------------------------------------------------------
# Toy tasks: the whole action sequence is fixed when the episode starts
# ----------------------------------------------------------------------------------------------------
def _replay(actions: list[str]) -> Act:
    remaining = list(actions)

    def act(observation: str) -> str:
        if not remaining:
            raise RuntimeError("the scripted toy demonstration ran out of actions before the episode ended")
        return remaining.pop(0)

    return act


def _toy_keys_policy(env, task: dict[str, Any], noisy: bool, rng: random.Random, blind_fraction: float = 0.5,
                     **_: Any) -> Act:
    """Clean: ``look`` then ``open <key>``. Noisy: a blind guess (a fraction ``blind_fraction``; right 10 % of
    the time by luck) or ``look`` then a wrong digit."""
    key = int(task["key"])
    if not noisy:
        return _replay(["look", f"open {key}"])
    if rng.random() < blind_fraction:
        return _replay([f"open {rng.randrange(10)}"])
    return _replay(["look", f"open {rng.choice([d for d in range(10) if d != key])}"])


def _toy_echo_policy(env, task: dict[str, Any], noisy: bool, rng: random.Random, **_: Any) -> Act:
    """Clean: box the code. Noisy: box another digit."""
    code = int(task["code"])
    return _replay([f"\\boxed{{{rng.choice([d for d in range(10) if d != code]) if noisy else code}}}"])


# Chosen so the default tiny model lands in the target success band (docs/toy_tasks.md).
TOY_KEYS_DEMONSTRATIONS = Demonstrations(
    policy=_toy_keys_policy, toy=True,
    sft_defaults={"noise": 0.7, "steps": 450, "clean_fraction": 2 / 3, "blind_fraction": 1.0})
TOY_ECHO_DEMONSTRATIONS = Demonstrations(
    policy=_toy_echo_policy, toy=True, sft_defaults={"noise": 0.7, "steps": 450, "clean_fraction": 2 / 3})


# ----------------------------------------------------------------------------------------------------
# Real tasks (the SIZE=tiny recipes): the next action depends on what the env showed
# ----------------------------------------------------------------------------------------------------
_INTERPRETER_INT = re.compile(r"<interpreter>\s*(-?\d+)\s*</interpreter>")


def _wrong_number(rng: random.Random, right: str) -> str:
    """A plausible wrong integer answer: the right one with one digit changed (or off by one)."""
    if right.lstrip("-").isdigit():
        digits = list(right)
        positions = [i for i, ch in enumerate(digits) if ch.isdigit()]
        i = rng.choice(positions)
        digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
        wrong = "".join(digits)
        return wrong if wrong != right else str(int(right) + 1)
    return str(rng.randrange(1000))


def _perturbed_expression(rng: random.Random, expression: str) -> str:
    """``expression`` with one digit changed: code that runs, but computes the wrong number."""
    positions = [i for i, ch in enumerate(expression) if ch.isdigit()]
    if not positions:
        return expression + "+1"
    i = rng.choice(positions)
    return expression[:i] + rng.choice([d for d in "123456789" if d != expression[i]]) + expression[i + 1:]


def names_phrase(text: str, phrase: str) -> bool:
    """``phrase`` occurs in ``text`` as whole words ("8 fl oz" is not named by "33.8 fl oz", "large" not by
    "x-large")."""
    return re.search(r"(?<![\w.-])" + re.escape(phrase) + r"(?![\w.-])", text) is not None


class _Episode:
    """Turn counter and the one mistake of a noisy episode, drawn from the turns where it changes the outcome."""

    def __init__(self, noisy: bool, rng: random.Random, first: int, stop: int):
        self.rng, self.turn = rng, 0
        self.mistake_turn = rng.randrange(first, stop) if noisy else -1

    def next_is_wrong(self) -> bool:
        wrong = self.turn == self.mistake_turn
        self.turn += 1
        return wrong


def _math_policy(env, task: dict[str, Any], noisy: bool, rng: random.Random, **_: Any) -> Act:
    """Box the training record's answer; the mistake is a wrong number."""
    episode = _Episode(noisy, rng, 0, 1)
    answer = str(task["answer"]).strip()

    def act(observation: str) -> str:
        wrong = episode.next_is_wrong()
        return f"\\boxed{{{_wrong_number(rng, answer) if wrong else answer}}}"

    return act


def _retool_policy(env, task: dict[str, Any], noisy: bool, rng: random.Random, **_: Any) -> Act:
    """Run the toy expression (or print the record's answer) in ``<code>``, then box the interpreter's number.
    Mistakes: answering without the tool, code with a wrong digit, or boxing a wrong number."""
    episode = _Episode(noisy, rng, 0, 2)
    answer = str(task["answer"]).strip()

    def act(observation: str) -> str:
        first, wrong = episode.turn == 0, episode.next_is_wrong()
        if first:
            expression = str(task.get("expression") or answer)
            if wrong and rng.random() < 0.5:  # answer without the tool, from "mental arithmetic"
                return f"\\boxed{{{_wrong_number(rng, answer)}}}"
            return f"<code>\nprint({_perturbed_expression(rng, expression) if wrong else expression})\n</code>"
        match = _INTERPRETER_INT.search(observation)
        value = match.group(1) if match else _wrong_number(rng, answer)
        return f"The result is \\boxed{{{_wrong_number(rng, value) if wrong else value}}}."

    return act


def _alfworld_policy(env, task: dict[str, Any], noisy: bool, rng: random.Random, **_: Any) -> Act:
    """Follow the PDDL planner (the env is built with ``expert=True``); the mistake is a random admissible
    action."""
    episode = _Episode(noisy, rng, 0, 4)

    def act(observation: str) -> str:
        wrong = episode.next_is_wrong()
        plan = env.expert_plan
        choice = plan[0] if plan else "look"
        if wrong:
            others = [a for a in env.admissible_actions if a != choice]
            choice = rng.choice(others) if others else choice
        return f"<action>{choice}</action>"

    return act


_WEBSHOP_NAVIGATION = {"back to search", "< prev", "description", "features", "reviews", "buy now"}


def _webshop_policy(env, task: dict[str, Any], noisy: bool, rng: random.Random, **_: Any) -> Act:
    """Search the goal's product query, open the target product when listed (else the first result), click
    the option values the instruction names, buy. Mistakes (never on the search turn): a random product, or
    buying without choosing options."""
    episode = _Episode(noisy, rng, 1, 3)
    clicked_options: set[str] = set()  # option values chosen on the product page

    def act(observation: str) -> str:
        wrong = episode.next_is_wrong()
        actions = env.admissible_actions
        clicks = [a[len("click["):-1] for a in actions if a.startswith("click[")]
        if any(a.startswith("search[") for a in actions):
            # the goal's short product query ("sunglasses"), as a shopper types it: a tiny model cannot copy
            # a whole instruction, and one query per product type gives a results page it can learn
            goal = env.simulator_goal(int(task["goal_index"])) if hasattr(env, "simulator_goal") else None
            return f"<action>search[{(goal or {}).get('query') or env.instruction}]</action>"
        if "buy now" in clicks:  # a product page: choose the options the instruction names, then buy
            instruction = (env.instruction or "").lower()
            for value in clicks:
                if (value not in _WEBSHOP_NAVIGATION and value not in clicked_options and not wrong
                        and names_phrase(instruction, value)):
                    clicked_options.add(value)
                    return f"<action>click[{value}]</action>"
            return "<action>click[buy now]</action>"
        products = [c for c in clicks if re.fullmatch(r"b0[a-z0-9]{8}", c)]
        target = str(task.get("target_asin") or "").lower()
        if wrong and products:
            return f"<action>click[{rng.choice(products)}]</action>"
        if target in products:
            return f"<action>click[{target}]</action>"
        return f"<action>click[{products[0] if products else 'back to search'}]</action>"

    return act


# Tuned so each SIZE=tiny recipe's tiny model knows its task's action format and succeeds sometimes
# (recipes/README.md). Multi-turn transcripts (2-3k tokens) train one at a time: a padded batch costs twice
# as much per token on CPU (the attention mask disables the fused causal kernel).
MATH_DEMONSTRATIONS = Demonstrations(
    policy=_math_policy, think_fillers=False,
    sft_defaults={"noise": 0.6, "steps": 200, "clean_fraction": 0.5, "num_demos": 256, "batch_size": 16})
RETOOL_DEMONSTRATIONS = Demonstrations(
    policy=_retool_policy, think_fillers=False,
    sft_defaults={"noise": 0.6, "steps": 250, "clean_fraction": 0.6, "num_demos": 128, "batch_size": 16})
# a game is lost by any wrong action among five: fewer noisy demos than the single-turn tasks
ALFWORLD_DEMONSTRATIONS = Demonstrations(
    policy=_alfworld_policy, env_kwargs={"expert": True},
    sft_defaults={"noise": 0.3, "steps": 200, "clean_fraction": 0.6, "num_demos": 24, "batch_size": 1})
# product ids are 10 random characters to copy from the page: more steps than the others
WEBSHOP_DEMONSTRATIONS = Demonstrations(
    policy=_webshop_policy,
    sft_defaults={"noise": 0.3, "steps": 500, "clean_fraction": 0.7, "num_demos": 32, "batch_size": 1})
