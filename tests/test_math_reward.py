"""Tests for async_rl.rewards.math_reward: extraction, equivalence, timeouts, overlong penalty."""

from __future__ import annotations

import functools
import os
import random
import string
import threading
import time
from pathlib import Path

import pytest

import async_rl.rewards.math_reward as math_reward_module
from async_rl.rewards.math_reward import (
    MAX_SYMBOLIC_CHARS,
    MathVerifier,
    extract_answer,
    grade_answer,
    is_equivalent,
    math_score,
    overlong_penalty,
)
from async_rl.envs.math_env import MathEnv, math_env_kwargs


@pytest.fixture(scope="module")
def verifier():
    """One warm pool for the module: each worker pays a ~1-3 s sympy import once."""
    pool = MathVerifier(max_workers=1, startup_timeout_s=120)
    assert pool.warm_up() == 1
    yield pool
    pool.close()


# ---------------------------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so the answer is \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"\boxed{\frac{a^{2}}{b_{1}}}", r"\frac{a^{2}}{b_{1}}"),  # nested braces
        (r"first \boxed{3}, then \boxed {7}", "7"),  # last box wins; space before brace
        (r"\fbox{42}", "42"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces are content
        (r"\boxed{a\\}", r"a\\"),  # an escaped backslash does not escape the closing brace
        (r"\boxed 9$", "9"),  # single-token argument
        (r"\boxed{ 12 }", "12"),
        (r"\boxedfoo{3} and \boxed{4}", "4"),  # `\boxedfoo` is another command
        (r"\boxed{4} then \boxedfoo{3}", "4"),
        # strict: only the last box counts, and it must be closed and non-empty
        (r"\boxed{5} but then \boxed{6", None),  # cut off in the last box: an earlier box does not stand in
        (r"\boxed{204", None),
        (r"204 \boxed{}", None),
        (r"\boxed{  }", None),
        ("The answer is 204.", None),
        ("we get 12 apples and then -3 pears", None),
        ("no numbers here", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_answer_is_strict_by_default(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"first \boxed{3}, then \boxed {7}", "7"),  # a usable last box still wins
        ("The answer is 204.", "204"),
        (r"\boxed{204", "204"),
        (r"204 \boxed{}", "204"),
        (r"\boxed{5} but then \boxed{6", "6"),  # the last number, not the earlier box
        ("we get 12 apples and then -3 pears", "-3"),  # minus sign kept
        ("5-3 = 2", "2"),
        ("3-5", "5"),  # binary minus is not a sign
        ("about 1,000 people", "1000"),
        ("length 3.5 m", "3.5"),  # decimals kept whole
        ("no numbers here", None),
    ],
)
def test_extract_answer_last_number_fallback_is_opt_in(text, expected):
    assert extract_answer(text, fallback_last_number=True) == expected


def test_careless_answers_score_zero_unless_the_fallback_is_asked_for():
    for careless in ("The answer is 204.", r"\boxed{204", r"204 \boxed{}", r"\boxed{204} wait, \boxed{"):
        assert math_score(careless, "204") == 0.0, careless
        assert grade_answer(careless, "204") == (None, False)
    assert math_score("The answer is 204.", "204", fallback_last_number=True) == 1.0
    assert math_score(r"204 \boxed{}", "204", fallback_last_number=True) == 1.0
    assert math_score(r"so \boxed{204}.", "204") == 1.0


def test_bad_timeout_is_a_clear_error():
    for bad in (0, -1.0, float("nan"), "5", True):
        with pytest.raises(ValueError, match="timeout_s"):
            math_score(r"\boxed{1}", "1", timeout_s=bad)
        with pytest.raises(ValueError, match="timeout_s"):
            extract_answer(r"\boxed{1}", timeout_s=bad)


# ---------------------------------------------------------------------------------------------- equivalence


def test_boxed_fraction_equals_decimal_and_slash_form(verifier):
    assert math_score(r"... \boxed{\frac{1}{2}}", "0.5", verifier=verifier) == 1.0
    assert math_score(r"... \boxed{\frac{1}{2}}", "1/2", verifier=verifier) == 1.0
    assert math_score(r"... \boxed{\dfrac{1}{2}}", r"\frac12", verifier=verifier) == 1.0


def test_nested_brace_answer_is_checked_symbolically(verifier):
    assert math_score(r"\boxed{\frac{\sqrt{8}}{2}}", r"\sqrt{2}", verifier=verifier) == 1.0
    assert math_score(r"\boxed{\frac{\sqrt{8}}{2}}", r"\sqrt{3}", verifier=verifier) == 0.0


def test_leading_zero_integer_equals_integer_without_subprocess():
    failing = MathVerifier(max_workers=1)
    failing.close()  # any use of the pool would raise: proves the integer fast path decides alone
    assert is_equivalent("025", "25", verifier=failing)
    assert not is_equivalent("026", "25", verifier=failing)
    assert math_score(r"\boxed{025}", "25", verifier=failing) == 1.0


def test_last_integer_without_box_is_scored_only_with_the_fallback():
    assert math_score("I think it is 17. Final: 42", "42") == 0.0
    assert math_score("I think it is 17. Final: 42", "42", fallback_last_number=True) == 1.0
    assert math_score("I think it is 42. Final: 17", "42", fallback_last_number=True) == 0.0


def test_no_answer_scores_zero():
    assert math_score("I have no idea.", "42") == 0.0
    assert math_score("", "42") == 0.0
    assert not is_equivalent(None, "42")


def test_wrong_answer_scores_zero(verifier):
    assert math_score(r"\boxed{\frac{1}{3}}", "0.5", verifier=verifier) == 0.0
    assert math_score(r"\boxed{41}", "42", verifier=verifier) == 0.0


def test_boxed_label_is_unwrapped():
    assert math_score(r"\boxed{7}", r"The answer is \boxed{7}") == 1.0


def test_empty_label_is_an_error():
    with pytest.raises(ValueError, match="reference label"):
        math_score(r"\boxed{1}", "  ")


def test_works_from_a_non_main_thread(verifier):
    # math_verify's own signal.alarm timeout raises ValueError outside the main thread; ours must not.
    results: list[object] = []

    def check() -> None:
        try:
            results.append(is_equivalent(r"\frac{1}{2}", "0.5", verifier=verifier))
        except Exception as exc:  # noqa: BLE001
            results.append(exc)

    worker = threading.Thread(target=check)
    worker.start()
    worker.join(60)
    assert results == [True]


def test_pathological_input_cannot_hang_past_timeout(verifier):
    assert verifier.warm_up() == 1
    runaway_worker_pid = verifier._idle.queue[0].process.pid
    timeouts_before = verifier.stats["timeouts"]
    started = time.monotonic()
    # sympy tries to evaluate this tower exactly and never finishes.
    assert not is_equivalent(r"9^{9^{9^{9}}}", "1", timeout_s=1.5, verifier=verifier)
    elapsed = time.monotonic() - started
    assert elapsed < 1.5 + 1.5, f"timeout not enforced: {elapsed:.2f} s"
    assert verifier.stats["timeouts"] == timeouts_before + 1
    with pytest.raises(ProcessLookupError):  # the runaway worker was killed and reaped
        os.kill(runaway_worker_pid, 0)
    # The pool recovers with a fresh worker (its start, a sympy import, can take seconds on a loaded machine)
    assert is_equivalent(r"\frac{3}{4}", "0.75", timeout_s=60, verifier=verifier)


# ---------------------------------------------------------------------------------------------- hostile input


@pytest.fixture()
def closed_verifier():
    """A pool that raises on any use: a check that passes with it never started a sympy worker."""
    pool = MathVerifier(max_workers=1)
    pool.close()
    return pool


def test_huge_integers_are_compared_without_int(closed_verifier):
    # 5,000 digits is past Python's int-string limit (4,300): int() would raise ValueError.
    huge = "9" * 5000
    assert math_score(rf"\boxed{{{huge}}}", "204", verifier=closed_verifier) == 0.0
    assert math_score(rf"\boxed{{00{huge}}}", huge, verifier=closed_verifier) == 1.0  # leading zeros
    assert math_score(rf"\boxed{{-{huge}}}", huge, verifier=closed_verifier) == 0.0  # sign matters
    assert math_score(r"\boxed{-0}", "0", verifier=closed_verifier) == 1.0
    assert math_score(r"\boxed{٢٠٤}", "204", verifier=closed_verifier) == 1.0  # Arabic-Indic digits are 204
    assert is_equivalent("1" + "0" * 10_000, "1" + "0" * 10_000, verifier=closed_verifier)


@functools.cache
def _megabyte_inputs() -> dict[str, str]:
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.digits + " {}\\$^_()"
    return {
        "random text": "".join(rng.choices(alphabet, k=1 << 20)),
        "open boxes": r"\boxed{" * 150_000,
        "open braces": r"\boxed{" + "{" * (1 << 20),
        "closed megabyte box": r"\boxed{" + "a" * (1 << 20) + "}",
        "megabyte integer": r"\boxed{" + "7" * (1 << 20) + "}",
        "no box, digits": "204 " * 260_000,
    }


@pytest.mark.parametrize("name", list(_megabyte_inputs()))
def test_megabyte_inputs_score_zero_within_the_limit_from_a_thread(name, closed_verifier):
    text = _megabyte_inputs()[name]
    assert len(text) >= 1_000_000
    results: list[object] = []

    def grade() -> None:
        started = time.monotonic()
        try:
            results.append((math_score(text, "204", timeout_s=1.0, verifier=closed_verifier),
                            time.monotonic() - started))
        except Exception as exc:  # noqa: BLE001 - the point is that nothing is raised
            results.append(exc)

    worker = threading.Thread(target=grade)
    worker.start()
    worker.join(30)
    assert len(results) == 1 and not isinstance(results[0], Exception), results
    score, elapsed = results[0]
    assert score == 0.0
    assert elapsed < 1.0 + 1.5, f"{name}: grading took {elapsed:.2f} s with timeout_s=1"


def test_extraction_is_linear_and_finds_the_answer_behind_broken_boxes():
    # The old extractor matched braces for every box: 150,000 open boxes cost ~10^11 steps (> 60 s).
    # Linear extraction finds the last box at once and returns long before its 20 s limit.
    assert extract_answer(r"\boxed{" * 150_000 + r"\boxed{7}", timeout_s=20) == "7"
    # One box holding 400,000 balanced braces: one pass over them.
    assert extract_answer(r"\boxed{" + "{}" * 200_000 + "7}", timeout_s=20) == "{}" * 200_000 + "7"


def test_extraction_stops_at_its_deadline():
    # Three million unmatched braces take seconds to scan; a 0.1 s limit stops the scan early.
    text = r"\boxed{" + "{" * 3_000_000
    started = time.monotonic()
    assert extract_answer(text, timeout_s=0.1) is None
    assert math_score(text, "1", timeout_s=0.1) == 0.0
    assert time.monotonic() - started < 2 * 0.1 + 1.0


ADVERSARIAL_LATEX = [
    r"\boxed{9^{9^{9^{9}}}}",  # sympy evaluates the tower exactly and never finishes
    r"\boxed{" + r"\sqrt{" * 400 + "2" + "}" * 400 + "}",
    r"\boxed{" + "(" * 2000 + "}",
    r"\boxed{\begin{matrix} 1 & 2 \\ 3}",
    r"\boxed{10^{10^{10}}!}",
    r"\boxed{\frac{1}{0}}",
]


def test_adversarial_latex_scores_zero_within_the_limit_from_threads(verifier):
    assert verifier.warm_up() == 1
    timeout_s = 1.5
    outcomes: dict[int, object] = {}

    def grade(index: int, text: str) -> None:
        started = time.monotonic()
        try:
            outcomes[index] = (math_score(text, "1", timeout_s=timeout_s, verifier=verifier),
                               time.monotonic() - started)
        except Exception as exc:  # noqa: BLE001
            outcomes[index] = exc

    threads = [threading.Thread(target=grade, args=(i, text)) for i, text in enumerate(ADVERSARIAL_LATEX)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(outcomes) == list(range(len(ADVERSARIAL_LATEX))), outcomes
    for index, outcome in outcomes.items():
        assert not isinstance(outcome, Exception), (ADVERSARIAL_LATEX[index][:40], outcome)
        score, elapsed = outcome
        assert score == 0.0
        # one worker for six threads: waiting for it, or for a replacement of a killed one, counts
        # against timeout_s (1.5 s of slack for a loaded 2-core machine)
        assert elapsed < timeout_s + 1.5
    assert is_equivalent(r"\frac{3}{4}", "0.75", timeout_s=60, verifier=verifier)  # the pool recovers


def test_waiting_for_a_busy_pool_counts_against_the_timeout(verifier):
    assert verifier.warm_up() == 1
    timeouts_before = verifier.stats["timeouts"]
    assert verifier._slots.acquire(timeout=60)  # the only worker is busy elsewhere
    try:
        started = time.monotonic()
        assert not is_equivalent(r"\frac{1}{2}", "0.5", timeout_s=0.3, verifier=verifier)
        assert time.monotonic() - started < 0.3 + 1.0
    finally:
        verifier._slots.release()
    assert verifier.stats["timeouts"] == timeouts_before + 1
    assert is_equivalent(r"\frac{1}{2}", "0.5", timeout_s=30, verifier=verifier)


def test_a_cold_pool_answers_within_the_limit_and_keeps_the_worker_it_started(monkeypatch):
    # A worker's start (the sympy import) takes ~0.2-3 s depending on the machine and its disk cache; hold it
    # for 2 s more, so that it outlasts the check's limit on every machine.
    wait_ready = math_reward_module._VerifierWorker.wait_ready

    def slow_wait_ready(worker, timeout_s):
        time.sleep(2.0)
        return wait_ready(worker, timeout_s)

    monkeypatch.setattr(math_reward_module._VerifierWorker, "wait_ready", slow_wait_ready)
    pool = MathVerifier(max_workers=1)
    try:
        started = time.monotonic()
        assert not is_equivalent(r"\frac{1}{2}", "0.5", timeout_s=0.3, verifier=pool)
        assert time.monotonic() - started < 0.3 + 1.0
        assert pool.stats["timeouts"] == 1 and pool.stats["checks"] == 0  # it never reached a worker
        assert pool.warm_up() == 1  # the start went on in the background
        assert is_equivalent(r"\frac{1}{2}", "0.5", timeout_s=30, verifier=pool)
    finally:
        pool.close()


def _naive_strict_extract(text: str) -> str | None:
    """The strict rule written the slow, obvious way (character by character) to check the fast one."""
    last = None
    for index in range(len(text)):
        for command in ("\\boxed", "\\fbox"):
            end = index + len(command)
            if text.startswith(command, index) and not (end < len(text) and text[end].isascii()
                                                        and text[end].isalpha()):
                last = end
    if last is None:
        return None
    index = last
    while index < len(text) and text[index].isspace():
        index += 1
    if index < len(text) and text[index] == "{":
        depth, cursor = 0, index
        content = None
        while cursor < len(text):
            if text[cursor] == "\\":
                cursor += 2
                continue
            if text[cursor] == "{":
                depth += 1
            elif text[cursor] == "}":
                depth -= 1
                if depth == 0:
                    content = text[index + 1 : cursor]
                    break
            cursor += 1
    else:
        token = ""
        while index < len(text) and not text[index].isspace() and text[index] not in "${}":
            token += text[index]
            index += 1
        content = token or None
    return content.strip() if content and content.strip() else None


def test_strict_extraction_matches_the_naive_rule_on_random_text():
    rng = random.Random(1)
    pieces = ["\\boxed", "\\fbox", "\\boxedx", "{", "}", "\\{", "\\}", "\\\\", "\\", " ", "$", "7", "-3", "a"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        assert extract_answer(text) == _naive_strict_extract(text), text


def test_long_answers_skip_the_symbolic_check(closed_verifier):
    long_answer = "x+" * MAX_SYMBOLIC_CHARS + "1"
    assert not is_equivalent(long_answer, "2", verifier=closed_verifier)
    assert is_equivalent(long_answer, long_answer, verifier=closed_verifier)  # string fast path still applies


# ---------------------------------------------------------------------------------------------- the option


def test_math_env_uses_the_strict_grader_and_the_option():
    strict = MathEnv()
    strict.reset({"prompt": "2+3?", "answer": "5"})
    result = strict.step("It is 5.")
    assert (result.reward, result.info["invalid_action"], result.info["extracted_answer"]) == (0.0, True, None)

    lenient = MathEnv(fallback_last_number=True)
    lenient.reset({"prompt": "2+3?", "answer": "5"})
    result = lenient.step("It is 5.")
    assert (result.reward, result.info["success"], result.info["extracted_answer"]) == (1.0, True, "5")

    with pytest.raises(ValueError, match="fallback_last_number"):
        MathEnv(fallback_last_number="yes")
    with pytest.raises(ValueError, match="verify_timeout_s"):
        MathEnv(verify_timeout_s=0)


def test_retool_final_answer_uses_the_same_grader():
    from async_rl.envs.retool import ReToolEnv

    task = {"prompt": "Compute 37*91-12.", "answer": "3355"}
    for fallback, reward in ((False, 0.0), (True, 1.0)):
        env = ReToolEnv(sandbox=object(), fallback_last_number=fallback)  # a final turn runs no code
        env.reset(task)
        result = env.step("The interpreter printed 3355.")
        assert (result.reward, result.done, result.info["invalid_action"]) == (reward, True, not fallback)
    with pytest.raises(ValueError, match="fallback_last_number"):
        ReToolEnv(sandbox=object(), fallback_last_number="false")


def test_configs_and_recipes_keep_the_fallback_off():
    from omegaconf import OmegaConf

    root = Path(__file__).resolve().parents[1]
    for name in ("math", "retool"):
        env_cfg = OmegaConf.load(root / "conf" / "env" / f"{name}.yaml")
        assert env_cfg.fallback_last_number is False, name
    assert math_env_kwargs(OmegaConf.load(root / "conf" / "env" / "math.yaml")) == {
        "verify_timeout_s": 5.0, "fallback_last_number": False}
    assert math_env_kwargs(OmegaConf.create({"verify_timeout_s": None})) == {}  # unset: strict defaults
    from async_rl.envs.retool import retool_env_kwargs

    assert retool_env_kwargs(OmegaConf.load(root / "conf" / "env" / "retool.yaml"))["fallback_last_number"] is False
    for recipe in ("aime", "aime_tiny", "retool", "retool_tiny"):
        recipe_cfg = OmegaConf.load(root / "recipes" / f"{recipe}.yaml")
        assert recipe_cfg.env.fallback_last_number is False, recipe


# ---------------------------------------------------------------------------------------------- overlong penalty


def test_overlong_penalty_edges():
    # L_max = 100, cache_fraction = 0.25 -> L_cache = 25, free up to 100 - 25 = 75.
    assert overlong_penalty(0, 100) == 0.0
    assert overlong_penalty(75, 100) == 0.0  # exactly at the boundary: still free
    assert overlong_penalty(76, 100) == pytest.approx(-0.04)  # -(76 - 75) / 25
    assert overlong_penalty(90, 100) == pytest.approx(-0.6)  # -(90 - 75) / 25
    assert overlong_penalty(99, 100) == pytest.approx(-0.96)  # -(99 - 75) / 25
    assert overlong_penalty(100, 100) == -1.0  # exactly at L_max: full penalty
    assert overlong_penalty(150, 100) == -1.0  # beyond L_max: clipped at -penalty


def test_overlong_penalty_scale_and_fractional_cache():
    # L_max = 10, cache_fraction = 0.25 -> L_cache = 2.5 (not rounded), free up to 7.5.
    assert overlong_penalty(7, 10) == 0.0
    assert overlong_penalty(8, 10) == pytest.approx(-0.2)  # -(8 - 7.5) / 2.5
    # penalty=0.5 halves the line: L_max = 4096, L_cache = 1024, free up to 3072.
    assert overlong_penalty(3584, 4096, penalty=0.5) == pytest.approx(-0.25)  # -0.5 * 512 / 1024
    assert overlong_penalty(5000, 4096, penalty=0.5) == -0.5


def test_overlong_penalty_rejects_bad_arguments():
    with pytest.raises(ValueError, match="max_response_length"):
        overlong_penalty(1, 0)
    with pytest.raises(ValueError, match="cache_fraction"):
        overlong_penalty(1, 10, cache_fraction=0.0)
