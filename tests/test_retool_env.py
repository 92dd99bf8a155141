"""ReToolEnv: code extraction rule, interpreter observations, final answers, turn limit, and the line between
the model's failures (observations) and the sandbox's failures (raise -> aborted step, never scored)."""

from __future__ import annotations

import socket

import pytest

from async_rl.envs.base import make_env, registered_env_names
from async_rl.envs.calls import run_env_step
from async_rl.envs.retool import (
    PROMPT_TEMPLATE,
    ReToolEnv,
    SandboxInfrastructureError,
    extract_code,
    make_retool_tasks,
    make_retool_toy_tasks,
    optimal_toy_action,
    retool_env_kwargs,
)
from async_rl.sandbox import SandboxFusionClient, SandboxResult

TASK = {"id": "t1", "prompt": "Compute 37*91-12.", "answer": "3355"}


class ScriptedSandbox:
    """Returns canned results (or raises) and records the programs it was given."""

    def __init__(self, *results):
        self.results = list(results)
        self.programs: list[str] = []

    def run(self, code, timeout_s=None, stdin=None):
        self.programs.append(code)
        result = self.results.pop(0)
        if isinstance(result, BaseException):
            raise result
        return result


def ok(stdout: str) -> SandboxResult:
    return SandboxResult(stdout, "", 0, False, None, 0.01)


# ------------------------------------------------------------------------------------------------
# The code rule
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, code", [
    ("Let me check. <code>print(1)</code>", "print(1)"),
    ("<code>\n```python\nprint(2)\n```\n</code>", "print(2)"),  # ReTool SFT format: fence inside the tag
    ("```python\nprint(3)\n```", "print(3)"),  # no tag: a python fence
    ("```py\nprint(4)\n```", "print(4)"),
    ("<code>a = 1</code> then <code>print(a)</code>", "a = 1\nprint(a)"),  # all blocks, in order
    ("<code>print(5)</code> and ```python\nignored\n```", "print(5)"),  # tags win over fences
    ("output was\n```\n3355\n```\nso \\boxed{3355}", None),  # untagged fence: not code
    ("<code>print(6)", None),  # unterminated (cut off): not run
    ("<code>   </code>", None),  # empty
    ("The answer is \\boxed{7}.", None),
])
def test_extract_code(text, code):
    assert extract_code(text) == code


# ------------------------------------------------------------------------------------------------
# Episodes against the real local sandbox
# ------------------------------------------------------------------------------------------------


def test_code_turn_then_boxed_answer_gets_reward_1():
    env = ReToolEnv()
    prompt = env.reset(TASK)
    assert prompt == PROMPT_TEMPLATE.replace("{prompt}", "Compute 37*91-12.")
    first = env.step("I will compute it.\n<code>\nprint(37*91-12)\n</code>")
    # 37*91 = 3367; 3367 - 12 = 3355
    assert first.observation == "<interpreter>\n3355\n</interpreter>"
    assert (first.reward, first.done) == (0.0, False)
    assert first.info["has_code"] and first.info["code_error_kind"] is None
    final = env.step("The interpreter says 3355, so the answer is \\boxed{3355}.")
    assert (final.observation, final.reward, final.done) == ("", 1.0, True)
    assert final.info["success"] and final.info["extracted_answer"] == "3355" and final.info["num_code_turns"] == 1
    with pytest.raises(RuntimeError, match="over"):
        env.step("again")


def test_runtime_error_is_an_observation_with_a_clean_traceback():
    env = ReToolEnv()
    env.reset(TASK)
    result = env.step("<code>\nprint('before')\nx = 1 / 0\n</code>")
    assert (result.reward, result.done) == (0.0, False)
    assert result.info["code_error_kind"] == "runtime_error"
    obs = result.observation
    assert obs.startswith("<interpreter>\nbefore\nTraceback")
    assert obs.endswith("ZeroDivisionError: division by zero\n</interpreter>")
    assert 'File "<code>", line 2' in obs and "main.py" not in obs  # the sandbox's temp path is hidden
    # the model can recover and still be rewarded
    assert env.step("\\boxed{3355}").reward == 1.0


def test_wrong_answer_and_missing_answer():
    env = ReToolEnv()
    env.reset(TASK)
    wrong = env.step("I think it is \\boxed{3356}.")
    assert (wrong.reward, wrong.done, wrong.info["success"], wrong.info["invalid_action"]) == (0.0, True, False, False)
    env.reset(TASK)
    nothing = env.step("I give up.")
    assert (nothing.reward, nothing.done, nothing.info["invalid_action"]) == (0.0, True, True)


def test_timeout_is_shown_to_the_model():
    env = ReToolEnv(code_timeout_s=1.0)
    env.reset(TASK)
    result = env.step("<code>while True:\n    pass</code>")
    assert result.info["code_error_kind"] == "timeout" and not result.done
    assert "TimeoutError: the code exceeded the time limit of 1 s" in result.observation


def test_persist_state_replays_earlier_cells():
    stateless = ReToolEnv()
    stateless.reset(TASK)
    stateless.step("<code>x = 37 * 91</code>")
    assert "NameError" in stateless.step("<code>print(x - 12)</code>").observation

    env = ReToolEnv(persist_state=True)
    env.reset(TASK)
    assert env.step("<code>x = 37 * 91\nprint('set')\ny = 1 / 0</code>").info["code_error_kind"] == "runtime_error"
    # the replay is silent (no 'set', no traceback) and x survives the cell's error, as in a notebook
    second = env.step("<code>print(x - 12)\nprint(undefined_name)</code>")
    assert second.observation.startswith("<interpreter>\n3355\nTraceback")
    assert 'File "<code>", line 2' in second.observation  # line numbers of this cell, not of the replay program


# ------------------------------------------------------------------------------------------------
# Observation size, turn limit
# ------------------------------------------------------------------------------------------------


def test_long_output_keeps_head_and_tail():
    env = ReToolEnv(max_observation_chars=100, sandbox=ScriptedSandbox(ok("a" * 300 + "END\n")))
    env.reset(TASK)
    obs = env.step("<code>print('a' * 300 + 'END')</code>").observation
    # 303 chars -> keep 50 head + 50 tail, 203 cut
    assert obs == "<interpreter>\n" + "a" * 50 + "\n...[203 chars truncated]...\n" + "a" * 47 + "END\n</interpreter>"


def test_empty_output_and_out_of_turns():
    sandbox = ScriptedSandbox(ok(""))
    env = ReToolEnv(max_turns=2, sandbox=sandbox)
    env.reset(TASK)
    assert env.step("<code>x = 1</code>").observation == "<interpreter>\n(no output)\n</interpreter>"
    last = env.step("<code>print(x)</code>")  # turn 2 of 2 still has code: not run, episode over
    assert (last.reward, last.done, last.info["out_of_turns"]) == (0.0, True, True)
    assert sandbox.programs == ["x = 1"]


# ------------------------------------------------------------------------------------------------
# Infrastructure failures raise (-> aborted step), never a reward
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sandbox_error", "unreachable"])
def test_sandbox_infrastructure_failure_raises_and_aborts_the_step(kind):
    broken = SandboxResult("", "", None, False, kind, 0.01, detail="server on fire")
    env = ReToolEnv(sandbox=ScriptedSandbox(broken))
    env.reset(TASK)
    with pytest.raises(SandboxInfrastructureError, match="server on fire"):
        env.step("<code>print(1)</code>")
    env = ReToolEnv(sandbox=ScriptedSandbox(broken))
    env.reset(TASK)
    outcome = run_env_step(env, "<code>print(1)</code>", timeout_s=10)
    assert outcome.aborted and outcome.result is None and "SandboxInfrastructureError" in outcome.error


def test_sandbox_exception_is_an_infrastructure_failure():
    env = ReToolEnv(sandbox=ScriptedSandbox(OSError("fork failed")))
    env.reset(TASK)
    with pytest.raises(SandboxInfrastructureError, match="OSError: fork failed"):
        env.step("<code>print(1)</code>")


def test_unreachable_fusion_server_aborts():
    with socket.socket() as probe:  # a port with nothing listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = SandboxFusionClient(url=f"http://127.0.0.1:{port}", max_retries=0, request_overhead_s=2.0)
    env = ReToolEnv(sandbox=client)
    env.reset(TASK)
    outcome = run_env_step(env, "<code>print(1)</code>", timeout_s=30)
    assert outcome.aborted and "unreachable" in outcome.error


# ------------------------------------------------------------------------------------------------
# Toy tasks, registry, config
# ------------------------------------------------------------------------------------------------


def test_toy_tasks_are_deterministic_and_correct():
    tasks = make_retool_toy_tasks(20, seed=1)
    assert tasks == make_retool_toy_tasks(20, seed=1)
    assert make_retool_toy_tasks(5, seed=1) == tasks[:5]  # a longer list extends a shorter one
    assert tasks != make_retool_toy_tasks(20, seed=2)
    for task in tasks:
        assert task["prompt"] == f"Compute {task['expression']}."
        assert task["answer"] == str(eval(task["expression"]))  # noqa: S307 - digits and operators only
        assert int(task["answer"]) > 0


def test_scripted_policy_solves_toy_tasks_with_the_real_sandbox():
    env = make_env("retool")
    for task in make_retool_toy_tasks(3, seed=0):
        env.reset(task)
        history = []
        for _ in range(env.max_turns):
            action = optimal_toy_action(task, history)
            result = env.step(action)
            history.append((action, result.observation))
            if result.done:
                break
        assert result.reward == 1.0 and len(history) == 2, history


def test_registry_and_config_kwargs():
    assert "retool" in registered_env_names()
    kwargs = retool_env_kwargs({"max_turns": 3, "code_timeout_s": 2.0, "persist_state": True,
                                "sandbox": {"kind": "local", "url": "http://x:1", "memory_limit_mb": 512}})
    assert kwargs["sandbox_kind"] == "local" and kwargs["sandbox_kwargs"] == {"memory_limit_mb": 512}
    env = make_env("retool", **kwargs)
    assert (env.max_turns, env.code_timeout_s, env.persist_state) == (3, 2.0, True)
    assert env.prompt_template == PROMPT_TEMPLATE
    fusion = retool_env_kwargs({"sandbox": {"kind": "fusion", "url": "http://x:1"}, "tool_prompt_template": None})
    assert fusion["sandbox_kwargs"] == {"url": "http://x:1"} and fusion["prompt_template"] is None
    env = make_env("retool", **fusion)
    assert env.reset(TASK) == "Compute 37*91-12."
    assert len(make_retool_tasks({"train_data": "toy", "num_tasks": 4}, seed=0)) == 4
    with pytest.raises(KeyError, match="answer"):
        env.reset({"id": "x", "prompt": "p"})


def test_memory_overrun_outside_processes_is_scored_not_aborted():
    # Issue 21's reproducer through the real sandbox and the env: memory held in socket buffers (charged
    # to the run's cgroup, to no process), then exec a tiny shell. It used to come back as sandbox_error,
    # so the step aborted and the trajectory was thrown away; it is the code's own overrun: an observation.
    from test_sandbox_attacks import SOCKET_BUFFER_OOM

    env = ReToolEnv(sandbox_kwargs={"memory_limit_mb": 512, "timeout_s": 20})
    assert env.sandbox.isolation.memory_scope == "cgroup", env.sandbox.isolation.warnings  # CI: root + cgroups
    env.reset(TASK)
    outcome = run_env_step(env, f"<code>{SOCKET_BUFFER_OOM}</code>", timeout_s=60)
    assert not outcome.aborted, outcome.error
    assert outcome.result.info["code_error_kind"] == "memory"
    assert "memory" in outcome.result.observation.lower() and not outcome.result.done
