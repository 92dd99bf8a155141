"""Every pattern applied to program output or model text runs in linear time (issue 39, finding 2).

A backtracking regex on a hostile input holds the GIL for seconds (a trainer stall the model can cause):
each parser gets adversarial inputs at the size limit and must finish well inside a time bound. Sizes:
program output at LocalSandbox's per-stream cap (64 KiB); model text at 128 Ki characters (math's
max_new_tokens of 8,192 tokens at 16 characters each, more than any env here generates). Measured on
the 2-core CI machine: the new code takes at most 36 ms per input (the math grader's brace walk over
128 Ki ``{``; most under 10 ms); the old one took 0.9 s (the traceback path at 64 KiB), 1.6 s and 3.5 s
(``<code>`` / ``<action>`` openers at 48 / 64 KiB) and 44 s (the fence pattern, 3,000 spaces), so the
0.25 s bound has a margin of 7x above the new code and 3.6x below the old. Best of three runs: scheduling noise on a shared
machine only ever adds time.
"""

from __future__ import annotations

import random
import re
import time

import pytest

from async_rl.envs import alfworld_env, retool, toy
from async_rl.envs.markup import fenced_blocks, tag_contents
from async_rl.envs.webshop import env as webshop_env
from async_rl.envs.webshop.simulator import parse_shop_action
from async_rl.rewards.math_reward import _fast_path, extract_answer

OUTPUT_LIMIT = 64 * 1024
MODEL_TEXT_LIMIT = 128 * 1024
TIME_BOUND_S = 0.25


def fill(unit: str, limit: int, prefix: str = "", suffix: str = "") -> str:
    """``prefix + unit * k + suffix`` at most ``limit`` characters long."""
    return prefix + unit * ((limit - len(prefix) - len(suffix)) // len(unit)) + suffix


def best_of_three(function, text) -> float:
    times = []
    for _ in range(3):
        started = time.perf_counter()
        function(text)
        times.append(time.perf_counter() - started)
    return min(times)


STDERR_ATTACKS = {
    # the measured stall: one `File "` and an unclosed path of `/tmp` (backtracked once per character)
    "unclosed_tmp_path": fill("/tmp", OUTPUT_LIMIT, prefix='File "'),
    "many_unclosed_files": fill('File "/tmp/a', OUTPUT_LIMIT),
    "long_path_then_no_line": fill("/tmp", OUTPUT_LIMIT, prefix='File "', suffix='main.py", lin'),
    "many_real_lines": fill('File "/workdir/main.py", line 7\n', OUTPUT_LIMIT),
}

MODEL_TEXT_ATTACKS = {
    "code_openers": fill("<code>", MODEL_TEXT_LIMIT),
    "action_openers": fill("<action>", MODEL_TEXT_LIMIT),
    "action_openers_mixed_case": fill("<AcTiOn>", MODEL_TEXT_LIMIT),
    # two optional runs of blanks before a lazy scan: cubic in the old fence pattern
    "fence_then_blanks": fill(" ", MODEL_TEXT_LIMIT, prefix="<code>```", suffix="</code>"),
    "fence_then_tabs_bare": fill("\t", MODEL_TEXT_LIMIT, prefix="```"),
    "python_fences_unclosed": fill("```python\n", MODEL_TEXT_LIMIT),
    "python_fence_blank_header": fill(" ", MODEL_TEXT_LIMIT, prefix="```", suffix="python"),
    "boxed_openers": fill("\\boxed{", MODEL_TEXT_LIMIT),
    "braces": fill("{", MODEL_TEXT_LIMIT, prefix="\\boxed"),
    "box_then_blanks": fill(" ", MODEL_TEXT_LIMIT, prefix="\\boxed"),
    "thousands": fill("1,", MODEL_TEXT_LIMIT),
    "decimals": fill("1.", MODEL_TEXT_LIMIT),
    "minus_digits": fill("-1", MODEL_TEXT_LIMIT),
    "digits": fill("7", MODEL_TEXT_LIMIT),
    "open_then_blanks": fill(" ", MODEL_TEXT_LIMIT, prefix="<action>open", suffix="x</action>"),
    "search_brackets": fill("] ", MODEL_TEXT_LIMIT, prefix="<action>search[", suffix="x</action>"),
    "search_blanks": fill(" ", MODEL_TEXT_LIMIT, prefix="<action>search", suffix="</action>"),
    "interpreter_blanks": fill(" ", MODEL_TEXT_LIMIT, prefix="<interpreter>", suffix="x"),
}

MODEL_TEXT_PARSERS = {
    "retool.extract_code": retool.extract_code,
    "retool.optimal_toy_action": lambda text: retool.optimal_toy_action({"expression": "1"}, [("", text)]),
    "webshop.parse_action": webshop_env.parse_action,
    "webshop.parse_shop_action": parse_shop_action,
    "alfworld.parse_action": alfworld_env.parse_action,
    "toy.parse_keys_action": toy.parse_keys_action,
    "toy.parse_boxed": toy.parse_boxed,
    "math.extract_answer_strict": extract_answer,
    "math.extract_answer_last_number": lambda text: extract_answer(text, fallback_last_number=True),
    "math.fast_path": lambda text: _fast_path(text, "1000"),
}


@pytest.mark.parametrize("attack", sorted(STDERR_ATTACKS))
def test_retool_traceback_cleaning_is_linear_on_hostile_stderr(attack):
    text = STDERR_ATTACKS[attack]
    assert len(text) <= OUTPUT_LIMIT
    assert best_of_three(lambda t: retool._clean_traceback(t, 3), text) < TIME_BOUND_S


@pytest.mark.parametrize("parser", sorted(MODEL_TEXT_PARSERS))
def test_parsers_of_model_text_are_linear_on_hostile_input(parser):
    slowest = {}
    for attack, text in MODEL_TEXT_ATTACKS.items():
        assert len(text) <= MODEL_TEXT_LIMIT
        slowest[attack] = best_of_three(MODEL_TEXT_PARSERS[parser], text)
    assert max(slowest.values()) < TIME_BOUND_S, sorted(slowest.items(), key=lambda item: -item[1])[:3]


def test_traceback_cleaning_keeps_a_huge_line_number_instead_of_raising():
    # int() refuses over 4,300 digits: the old substitution raised ValueError out of format_interpreter_output
    line = "9" * 5000
    text = f'Traceback (most recent call last):\n  File "/workdir/main.py", line {line}, in <module>\n'
    assert retool._clean_traceback(text, 2) == text
    cleaned = retool._clean_traceback('  File "/workdir/main.py", line 12, in <module>\n', 2)
    assert cleaned == '  File "<code>", line 10, in <module>\n'
    assert retool._clean_traceback('File "/tmp/tmpab12/x.py", line 3', 0) == 'File "<code>", line 3'
    assert retool._clean_traceback('File "/usr/lib/python3.11/x.py", line 3', 0) == 'File "/usr/lib/python3.11/x.py", line 3'


# The patterns the parsers used to apply: they define the results the linear versions must reproduce.
REFERENCE_CODE_TAG = re.compile(r"<code>(.*?)</code>", re.DOTALL)
REFERENCE_ACTION_TAG = re.compile(r"<action>(.*?)</action>", re.DOTALL | re.IGNORECASE)
REFERENCE_ANY_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n?(.*?)```", re.DOTALL | re.IGNORECASE)
REFERENCE_PYTHON_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
REFERENCE_SANDBOX_FILE = re.compile(r'File "[^"]*?(?:main\.py|/tmp[^"]*\.py)", line (\d+)')

PIECES = ["`", "```", " ", "\t", "\n", "py", "python", "PYTHON3", "thon", "3", "x", "<code>", "</code>", "<action>",
          "</ACTION>", "<Action>", "</action>", 'File "', '"', ", line ", "12", "/tmp", "main.py", ".py", "/x/"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_linear_extractors_give_the_reference_patterns_results(seed):
    rng = random.Random(seed)
    for _ in range(3000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 14)))
        assert tag_contents(text, "code") == REFERENCE_CODE_TAG.findall(text)
        assert tag_contents(text, "action", ignore_case=True) == REFERENCE_ACTION_TAG.findall(text)
        assert fenced_blocks(text, require_python=False) == REFERENCE_ANY_FENCE.findall(text)
        assert fenced_blocks(text, require_python=True) == REFERENCE_PYTHON_FENCE.findall(text)
        expected = REFERENCE_SANDBOX_FILE.sub(lambda m: f'File "<code>", line {max(int(m.group(1)) - 3, 1)}', text)
        assert retool._clean_traceback(text, 3) == expected
