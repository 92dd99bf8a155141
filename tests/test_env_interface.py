"""Tests for the shared Env interface, the safe step runners, the registry and MathEnv."""

from __future__ import annotations

import threading
import time

import pytest

from async_rl.envs import (
    Env,
    EnvAborted,
    MathEnv,
    StepResult,
    make_env,
    register_env,
    registered_env_names,
    run_env_reset,
    run_env_step,
)


class EchoEnv(Env):
    """Two-turn toy env: reward 1 when the action equals the task's answer."""

    max_turns = 2

    def __init__(self, greeting: str = "say the word") -> None:
        self.greeting = greeting
        self.answer = None
        self.closed = False

    def reset(self, task):
        self.answer = task["answer"]
        return f"{self.greeting}: {task['prompt']}"

    def step(self, action_text):
        correct = action_text == self.answer
        return StepResult(observation="ok" if correct else "try again", reward=float(correct), done=correct,
                          info={"success": correct})

    def close(self):
        self.closed = True


class RaisingEnv(EchoEnv):
    def step(self, action_text):
        raise ValueError("boom: broken simulator")


class SleepingEnv(EchoEnv):
    def __init__(self, sleep_s: float = 10.0) -> None:
        super().__init__()
        self.sleep_s = sleep_s

    def reset(self, task):
        time.sleep(self.sleep_s)
        return "never"

    def step(self, action_text):
        time.sleep(self.sleep_s)
        return StepResult("late", 1.0, True)


class GarbageEnv(EchoEnv):
    def __init__(self, value) -> None:
        super().__init__()
        self.value = value

    def step(self, action_text):
        return self.value


# ---------------------------------------------------------------------------------------------- run_env_step


def test_normal_step_returns_result():
    env = EchoEnv()
    assert env.reset({"prompt": "p", "answer": "hi"}) == "say the word: p"
    outcome = run_env_step(env, "hi", timeout_s=5)
    assert not outcome.aborted and outcome.error is None
    assert outcome.result == StepResult("ok", 1.0, True, {"success": True})
    assert outcome.unwrap() is outcome.result


def test_raising_env_becomes_aborted_with_message():
    env = RaisingEnv()
    env.reset({"prompt": "p", "answer": "a"})
    outcome = run_env_step(env, "x", timeout_s=5)
    assert outcome.aborted and outcome.result is None and not outcome.timed_out
    assert "ValueError: boom: broken simulator" in outcome.error
    with pytest.raises(EnvAborted, match="boom"):
        outcome.unwrap()


def test_hanging_env_is_aborted_promptly():
    env = SleepingEnv(sleep_s=10)
    started = time.monotonic()
    outcome = run_env_step(env, "x", timeout_s=0.3)
    elapsed = time.monotonic() - started
    assert outcome.aborted and outcome.timed_out and outcome.result is None
    assert "timed out after 0.3 s" in outcome.error
    assert elapsed < 1.5, f"run_env_step waited {elapsed:.2f} s for a 0.3 s timeout"


def test_hanging_reset_is_aborted_promptly():
    started = time.monotonic()
    outcome = run_env_reset(SleepingEnv(sleep_s=10), {"prompt": "p", "answer": "a"}, timeout_s=0.3)
    assert outcome.aborted and outcome.timed_out and outcome.observation is None
    assert time.monotonic() - started < 1.5


@pytest.mark.parametrize(
    ("value", "message"),
    [(None, "expected StepResult"), (StepResult("o", float("nan"), True), "non-finite reward"),
     (StepResult(None, 1.0, True), "observation of type NoneType")],
)
def test_invalid_step_return_is_aborted(value, message):
    outcome = run_env_step(GarbageEnv(value), "x", timeout_s=5)
    assert outcome.aborted and message in outcome.error


def test_invalid_timeout_is_rejected():
    with pytest.raises(ValueError, match="timeout_s"):
        run_env_step(EchoEnv(), "x", timeout_s=0)


# ---------------------------------------------------------------------------------------------- registry


def test_make_env_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as error:
        make_env("no_such_env")
    message = str(error.value)
    assert "unknown env 'no_such_env'" in message
    assert "math" in message and "Valid names:" in message


def test_register_and_make_custom_env():
    register_env("test_echo")(EchoEnv)
    env = make_env("test_echo", greeting="hello")
    assert isinstance(env, EchoEnv) and env.reset({"prompt": "x", "answer": "y"}) == "hello: x"
    assert "test_echo" in registered_env_names()
    register_env("test_echo")(EchoEnv)  # re-registering the same class is harmless
    with pytest.raises(ValueError, match="already registered"):
        register_env("test_echo")(RaisingEnv)


def test_make_env_by_import_path():
    env = make_env("async_rl.envs.math_env:MathEnv", answer_key="solution")
    assert isinstance(env, MathEnv) and env.answer_key == "solution"


def test_env_context_manager_closes():
    with EchoEnv() as env:
        pass
    assert env.closed


# ---------------------------------------------------------------------------------------------- MathEnv


def test_math_env_end_to_end():
    env = make_env("math")
    assert isinstance(env, MathEnv) and env.max_turns == 1
    task = {"id": "q1", "prompt": "What is 1/2 as a decimal?", "answer": "0.5"}
    assert env.reset(task) == "What is 1/2 as a decimal?"
    outcome = run_env_step(env, r"Half is \boxed{\frac{1}{2}}", timeout_s=120)  # first use starts a worker
    assert not outcome.aborted, outcome.error
    assert outcome.result.reward == 1.0 and outcome.result.done
    assert outcome.result.info == {"extracted_answer": r"\frac{1}{2}", "success": True, "invalid_action": False}

    env.reset({"id": "q2", "prompt": "2+3?", "answer": "5"})
    wrong = env.step(r"\boxed{6}")
    assert wrong.reward == 0.0 and wrong.done and wrong.info["success"] is False

    env.reset({"id": "q3", "prompt": "2+3?", "answer": "5"})
    silent = env.step("I refuse to answer.")
    assert silent.reward == 0.0 and silent.info["invalid_action"] is True


def test_math_env_misuse_is_reported():
    env = MathEnv()
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("1")
    assert run_env_step(env, "1", timeout_s=5).aborted  # through the runner it is an abort, not a reward
    env.reset({"prompt": "p", "answer": "1"})
    env.step(r"\boxed{1}")
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step(r"\boxed{1}")
    with pytest.raises(KeyError, match="answer_key"):
        env.reset({"prompt": "p"})


def test_step_runs_on_another_thread():
    seen = []

    class ThreadRecordingEnv(EchoEnv):
        def step(self, action_text):
            seen.append(threading.current_thread())
            return super().step(action_text)

    env = ThreadRecordingEnv()
    env.reset({"prompt": "p", "answer": "a"})
    run_env_step(env, "a", timeout_s=5)
    assert seen and seen[0] is not threading.current_thread()


def test_steps_run_on_the_reused_default_pool_workers():
    from async_rl.envs.calls import default_env_pool

    class NamingEnv(EchoEnv):
        def step(self, action_text):
            return StepResult(threading.current_thread().name, 0.0, False)

    def scenario():
        env = NamingEnv()
        return [run_env_step(env, "a", timeout_s=5).result.observation for _ in range(50)]

    scenario()  # warm the pool up
    started = default_env_pool()._started_threads
    names = scenario()
    assert all(name.startswith("env-call-default") for name in names)
    # 50 steps start no thread per call; at most a couple more workers may be woken when earlier
    # tests left hung calls occupying some (the pool wakes extra workers for calls stuck behind them)
    assert default_env_pool()._started_threads - started <= 2


def test_construct_step_and_close_timeouts_name_the_call():
    from async_rl.envs.calls import run_env_close, run_env_construct

    hung_close = SleepingEnv(sleep_s=10)
    hung_close.close = lambda: time.sleep(10)
    closing = run_env_close(hung_close, timeout_s=0.2)
    assert closing.aborted and closing.timed_out and closing.error == "env.close timed out after 0.2 s"
    building = run_env_construct(lambda: time.sleep(10), timeout_s=0.2)
    assert building.aborted and building.timed_out and building.error == "env construction timed out after 0.2 s"


def test_every_task_env_registers_its_facts_and_the_entry_points_read_them():
    """train.py and eval.py take task loaders, kwargs and eval defaults from the env registry (envs/facts.py):
    the names match the config's choices, and a newly registered env needs no edit of either entry point."""
    from omegaconf import OmegaConf

    from async_rl.envs.base import Env, StepResult as _StepResult
    from async_rl.envs.facts import EnvFacts, env_facts, env_names_with_facts, register_env_facts
    from async_rl.eval import load_sets, make_env_factory
    from async_rl.train import env_kwargs, make_tasks
    from async_rl.envs.settings import TASK_ENVS

    assert env_names_with_facts() == sorted(TASK_ENVS)
    assert env_facts("webshop").eval_split == "test" and env_facts("alfworld").takes_max_turns
    assert env_facts("toy_keys").toy_eval_set and not env_facts("math").takes_max_turns
    with pytest.raises(ValueError, match="env 'nope' has no registered facts"):
        env_facts("nope")

    @register_env("test_facts_env")
    class FactsEnv(Env):
        def __init__(self, max_turns=1, flavour="plain"):
            self.max_turns, self.flavour = max_turns, flavour

        def reset(self, task):
            return task["prompt"]

        def step(self, action):
            return _StepResult(observation=None, reward=0.0, done=True)

    register_env_facts("test_facts_env", EnvFacts(
        make_tasks=lambda cfg, seed: [{"id": f"t{seed}", "prompt": "p"}] * cfg.num_tasks,
        env_kwargs=lambda cfg: {"flavour": cfg.flavour}, takes_max_turns=True, toy_eval_set=False))
    cfg = OmegaConf.create({"name": "test_facts_env", "num_tasks": 2, "flavour": "spicy"})
    assert make_tasks(cfg, 3) == [{"id": "t3", "prompt": "p"}] * 2 and env_kwargs(cfg) == {"flavour": "spicy"}
    built = make_env_factory(cfg, max_turns=4)()
    assert (built.max_turns, built.flavour) == (4, "spicy")
    with pytest.raises(ValueError, match="no evaluation sets for env 'test_facts_env'"):
        load_sets(OmegaConf.create({"eval_sets": [], "limit": None, "seed": 0}), cfg)
    from async_rl.envs import facts as facts_module

    facts_module._FACTS.pop("test_facts_env")
