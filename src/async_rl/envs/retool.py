"""ReTool: multi-turn math with a Python interpreter (ReTool, Feng et al. 2025), registered as ``"retool"``.

    prompt = env.reset({"id", "prompt", "answer"})       # the question wrapped in PROMPT_TEMPLATE
    env.step("Let me compute. <code>print(37*91-12)</code>")
        -> StepResult("<interpreter>\\n3355\\n</interpreter>", 0.0, done=False)
    env.step("So the answer is \\boxed{3355}.")
        -> StepResult("", 1.0, done=True, info={"success": True, ...})

A turn with ``<code>`` blocks runs them in the shared sandbox (:func:`get_shared_sandbox`); a turn without
code is the final answer, graded by ``math_score``. A sandbox infrastructure failure raises
:class:`SandboxInfrastructureError` (an aborted step). Tasks: :func:`make_retool_tasks`.

Details: docs/evaluation.md (The ReTool format).
"""

from __future__ import annotations

import json
import random
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from async_rl.envs.base import Env, StepResult, register_env
from async_rl.envs.demonstrations import RETOOL_DEMONSTRATIONS
from async_rl.envs.facts import EnvFacts, register_env_facts
from async_rl.envs.markup import fenced_blocks, tag_contents
from async_rl.envs.settings import RETOOL_PROMPT_TEMPLATE
from async_rl.rewards.math_reward import MathVerifier, extract_answer, grade_answer

__all__ = [
    "PROMPT_TEMPLATE",
    "ReToolEnv",
    "SandboxInfrastructureError",
    "extract_code",
    "format_interpreter_output",
    "get_shared_sandbox",
    "make_retool_tasks",
    "make_retool_toy_tasks",
    "optimal_toy_action",
    "retool_env_kwargs",
]

#: Prompt shown to the policy; ``{prompt}`` is the task's prompt field (the bare question). The text is the env
#: settings' default (``env.tool_prompt_template``, envs/settings.py)
PROMPT_TEMPLATE = RETOOL_PROMPT_TEMPLATE

# A traceback's file line. The path runs to the next quote with no backtracking (possessive), so a
# hostile stderr of `File "` and 64 KiB of `/tmp` is one scan, not one per character.
_TRACEBACK_FILE = re.compile(r'File "([^"]*+)", line (\d++)')
_MAX_LINE_DIGITS = 9  # int() refuses over 4,300 digits; no real program has a billion lines
_INTERPRETER_INTEGER = re.compile(r"<interpreter>\s*+(-?\d++)\s*+</interpreter>")

_INFRASTRUCTURE_KINDS = ("sandbox_error", "unreachable")


class SandboxInfrastructureError(RuntimeError):
    """The sandbox failed (not the model's code): the step must abort, the trajectory is not scored."""


# --------------------------------------------------------------------------------------------------
# Parsing and formatting
# --------------------------------------------------------------------------------------------------


def extract_code(text: str) -> str | None:
    """The program to run for one model turn (rule 1 of the module docstring), or None when it has no code."""
    blocks = tag_contents(text, "code")
    if blocks:
        programs = []
        for block in blocks:
            fenced = fenced_blocks(block, require_python=False)
            programs.append("\n".join(fenced) if fenced else block)
    else:
        programs = fenced_blocks(text, require_python=True)
    programs = [p.strip("\n") for p in programs if p.strip()]
    return "\n".join(programs) if programs else None


def _truncate_middle(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    return f"{text[:head]}\n...[{len(text) - limit} chars truncated]...\n{text[len(text) - tail:]}"


def _is_sandbox_file(path: str) -> bool:
    """LocalSandbox writes the code to <workdir>/main.py; SandboxFusion uses its own names under /tmp."""
    return path.endswith("main.py") or (path.endswith(".py") and "/tmp" in path[:-3])


def _clean_traceback(text: str, line_offset: int) -> str:
    """Hide the sandbox's temporary path (runs differ only in it) and undo the replay prelude's line shift.

    Linear in ``len(text)`` (the stderr is the program's, i.e. the model's, to choose).
    """

    def replace(match: re.Match) -> str:
        path, line = match.group(1), match.group(2)
        if not _is_sandbox_file(path) or len(line) > _MAX_LINE_DIGITS:
            return match.group(0)
        return f'File "<code>", line {max(int(line) - line_offset, 1)}'

    return _TRACEBACK_FILE.sub(replace, text)


def format_interpreter_output(result: Any, max_chars: int = 2048, line_offset: int = 0,
                              timeout_s: float | None = None) -> str:
    """The observation for one code run: ``<interpreter>\\n...\\n</interpreter>`` (see the module docstring).

    Raises:
        SandboxInfrastructureError: the result is an infrastructure failure.
    """
    kind = getattr(result, "error_kind", None)
    if kind in _INFRASTRUCTURE_KINDS:
        detail = getattr(result, "detail", None) or getattr(result, "stderr", "")
        raise SandboxInfrastructureError(f"sandbox {kind}: {detail}")
    parts = [result.stdout.rstrip("\n")] if result.stdout.strip() else []
    stderr = _clean_traceback(result.stderr, line_offset).rstrip("\n")
    if stderr.strip():
        parts.append(stderr)
    if kind == "timeout":
        limit = f" of {timeout_s:g} s" if timeout_s else ""
        parts.append(f"TimeoutError: the code exceeded the time limit{limit} and was stopped")
    elif kind == "cpu_limit":
        parts.append("TimeoutError: the code exceeded the CPU time limit and was stopped")
    elif kind == "memory" and "MemoryError" not in stderr:
        parts.append("MemoryError: the code exceeded the memory limit")
    elif kind == "file_size":
        parts.append("OSError: the code exceeded the file size limit")
    elif kind == "killed":
        code = getattr(result, "exit_code", None)
        parts.append(f"Killed (signal {-code})" if isinstance(code, int) and code < 0 else "Killed")
    output = "\n".join(parts) if parts else "(no output)"
    return f"<interpreter>\n{_truncate_middle(output, max_chars)}\n</interpreter>"


def _replay_prelude(cells: Sequence[str]) -> str:
    """Code that re-runs earlier cells with stdout/stderr silenced (``persist_state``)."""
    lines = [
        "import contextlib as _rt_ctx, io as _rt_io",
        f"for _rt_cell in {list(cells)!r}:",
        "    with _rt_ctx.redirect_stdout(_rt_io.StringIO()), _rt_ctx.redirect_stderr(_rt_io.StringIO()):",
        "        try:",
        "            exec(compile(_rt_cell, '<replay>', 'exec'), globals())",
        "        except BaseException:",
        "            pass",
        "del _rt_ctx, _rt_io, _rt_cell",
    ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# Shared sandboxes
# --------------------------------------------------------------------------------------------------

_SANDBOXES: dict[str, Any] = {}
_SANDBOXES_LOCK = threading.Lock()


def get_shared_sandbox(kind: str = "local", **kwargs: Any):
    """One sandbox per ``(kind, kwargs)`` in this process (``LocalSandbox`` probes the machine and runs a
    smoke test when created; every env of a run shares it). Raises :class:`SandboxInfrastructureError`
    when it cannot be created."""
    from async_rl.sandbox import make_sandbox

    key = json.dumps([kind, kwargs], sort_keys=True, default=str)
    with _SANDBOXES_LOCK:
        sandbox = _SANDBOXES.get(key)
        if sandbox is None:
            try:
                sandbox = make_sandbox(kind, **kwargs)
            except (ValueError, TypeError):
                raise  # a config error (unknown kind, bad or misspelt option): not an infrastructure failure
            except Exception as exc:  # noqa: BLE001 - SandboxUnavailableError, OSError, ...
                raise SandboxInfrastructureError(f"cannot create the {kind!r} sandbox: {exc}") from exc
            _SANDBOXES[key] = sandbox
        return sandbox


# --------------------------------------------------------------------------------------------------
# The environment
# --------------------------------------------------------------------------------------------------


@register_env("retool")
class ReToolEnv(Env):
    """Math with a code interpreter; see the module docstring for the exact turn rules.

    Args:
        max_turns: model turns per episode (code turns + the final answer turn).
        sandbox_kind: ``"local"`` or ``"fusion"`` (:func:`async_rl.sandbox.make_sandbox`).
        sandbox_kwargs: options of the sandbox (e.g. ``{"url": ..., "timeout_s": 10}`` for fusion).
        sandbox: a ready sandbox object (anything with ``run(code, timeout_s=None) -> SandboxResult``);
            overrides ``sandbox_kind`` / ``sandbox_kwargs``.
        code_timeout_s: wall-clock limit per code run (None: the sandbox's default).
        max_observation_chars: interpreter output longer than this keeps its head and tail.
        persist_state: replay earlier code turns before each run (notebook-like state; turns that hit a
            time or memory limit are not replayed).
        prompt_template: ``reset`` returns ``prompt_template.replace("{prompt}", task[prompt_key])``; None or
            ``"{prompt}"`` returns the task's prompt unchanged.
        prompt_key, answer_key: task fields of the question and the reference answer.
        verify_timeout_s, verifier, fallback_last_number: as in :class:`async_rl.envs.math_env.MathEnv`
            (the grader is strict by default: the last closed, non-empty ``\\boxed{}`` only).

    ``step`` info: ``turn``, ``has_code``, and for code turns ``code_error_kind`` (None when it ran
    cleanly); for the final turn ``extracted_answer``, ``success``, ``invalid_action``, ``num_code_turns``.
    """

    def __init__(
        self,
        max_turns: int = 8,
        sandbox_kind: str = "local",
        sandbox_kwargs: Mapping[str, Any] | None = None,
        sandbox: Any = None,
        code_timeout_s: float | None = 10.0,
        max_observation_chars: int = 2048,
        persist_state: bool = False,
        prompt_template: str | None = PROMPT_TEMPLATE,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        verify_timeout_s: float = 5.0,
        verifier: MathVerifier | None = None,
        fallback_last_number: bool = False,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if max_observation_chars < 16:
            raise ValueError(f"max_observation_chars must be >= 16, got {max_observation_chars}")
        if prompt_template is not None and "{prompt}" not in prompt_template:
            raise ValueError(f"prompt_template must contain '{{prompt}}', got {prompt_template!r}")
        self.max_turns = int(max_turns)
        self.sandbox_kind = sandbox_kind
        self.sandbox_kwargs = dict(sandbox_kwargs or {})
        self._sandbox = sandbox
        self.code_timeout_s = code_timeout_s
        self.max_observation_chars = int(max_observation_chars)
        self.persist_state = bool(persist_state)
        self.prompt_template = prompt_template
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        self.verify_timeout_s = verify_timeout_s
        self.verifier = verifier
        if not isinstance(fallback_last_number, bool):
            raise ValueError(f"fallback_last_number must be true or false, got {fallback_last_number!r}")
        self.fallback_last_number = fallback_last_number
        self._label: str | None = None
        self._turn = 0
        self._done = True
        self._cells: list[str] = []  # code of earlier turns to replay (persist_state)
        self._code_turns = 0

    @property
    def sandbox(self):
        """The sandbox (created on first use; shared, see :func:`get_shared_sandbox`)."""
        if self._sandbox is None:
            self._sandbox = get_shared_sandbox(self.sandbox_kind, **self.sandbox_kwargs)
        return self._sandbox

    def reset(self, task: dict[str, Any]) -> str:
        for key in (self.prompt_key, self.answer_key):
            if key not in task:
                raise KeyError(
                    f"retool task {task.get('id', '?')!r} has no {key!r} field (fields: {sorted(task)}); "
                    "set prompt_key/answer_key to the dataset's field names"
                )
        prompt = task[self.prompt_key]
        if not isinstance(prompt, str):
            raise TypeError(f"retool task prompt must be text, got {type(prompt).__name__}")
        label = task[self.answer_key]
        if label is None or not str(label).strip():
            raise ValueError(f"retool task {task.get('id', '?')!r} has an empty reference answer")
        label = str(label).strip()
        if "\\boxed" in label or "\\fbox" in label:
            label = extract_answer(label) or label
        self._label = label
        self._turn = 0
        self._done = False
        self._cells = []
        self._code_turns = 0
        return self.prompt_template.replace("{prompt}", prompt) if self.prompt_template else prompt

    def step(self, action_text: str) -> StepResult:
        if self._label is None:
            raise RuntimeError("ReToolEnv.step called before reset")
        if self._done:
            raise RuntimeError("ReToolEnv episode is over; call reset for the next task")
        self._turn += 1
        code = extract_code(action_text)
        info: dict[str, Any] = {"turn": self._turn, "has_code": code is not None, "success": False,
                                "invalid_action": False}
        if code is None:
            return self._final_answer(action_text, info)
        if self._turn >= self.max_turns:
            self._done = True
            info.update(out_of_turns=True, num_code_turns=self._code_turns)
            return StepResult(observation="", reward=0.0, done=True, info=info)
        observation, error_kind = self._run_code(code)
        self._code_turns += 1
        info["code_error_kind"] = error_kind
        info["tool_executed"] = True  # counted per trajectory by the driver (train/tool_calls)
        return StepResult(observation=observation, reward=0.0, done=False, info=info)

    # -- internals ---------------------------------------------------------------------------------

    def _final_answer(self, action_text: str, info: dict[str, Any]) -> StepResult:
        self._done = True
        predicted, correct = grade_answer(action_text, self._label, timeout_s=self.verify_timeout_s,
                                          verifier=self.verifier, fallback_last_number=self.fallback_last_number)
        info.update(extracted_answer=predicted, success=correct, invalid_action=predicted is None,
                    num_code_turns=self._code_turns)
        return StepResult(observation="", reward=1.0 if correct else 0.0, done=True, info=info)

    def _run_code(self, code: str) -> tuple[str, str | None]:
        program, offset = code, 0
        if self.persist_state and self._cells:
            prelude = _replay_prelude(self._cells)
            program, offset = prelude + code, prelude.count("\n")
        try:
            result = self.sandbox.run(program, timeout_s=self.code_timeout_s)
        except SandboxInfrastructureError:
            raise
        except Exception as exc:  # noqa: BLE001 - the sandbox itself broke (not the model's code)
            raise SandboxInfrastructureError(f"sandbox run failed: {type(exc).__name__}: {exc}") from exc
        observation = format_interpreter_output(result, self.max_observation_chars, offset, self.code_timeout_s)
        # Replayed later like a notebook: a cell that raised still ran up to the error (the replay catches
        # the exception again); one that hit a resource limit would hit it again, so it is left out.
        if self.persist_state and result.error_kind in (None, "runtime_error"):
            self._cells.append(code)
        return observation, result.error_kind


# --------------------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------------------

# (expression format, value); operands are drawn so every value is a positive integer
_TOY_FORMS: tuple[tuple[str, Any], ...] = (
    ("{a}*{b}-{c}", lambda a, b, c: a * b - c),
    ("{a}*{b}+{c}", lambda a, b, c: a * b + c),
    ("({a}+{b})*{c}", lambda a, b, c: (a + b) * c),
    ("{a}*{b}*{c}", lambda a, b, c: a * b * c),
    ("{a}**2-{b}", lambda a, b, c: a**2 - b),
)


def make_retool_toy_tasks(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` synthetic arithmetic tasks (``"Compute 37*91-12."``, answer ``"3355"``) for CPU tests and demos.

    Records: ``{"id": f"retool_toy-s{seed}-{i}", "env": "retool", "prompt", "question", "answer",
    "expression", "source": "retool_toy"}``. Same ``(n, seed)`` -> same list; a longer list extends a
    shorter one. Running the expression in ``<code>`` solves it exactly; mental arithmetic is error-prone.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"retool_toy:{seed}")
    tasks = []
    for i in range(n):
        form, value_of = rng.choice(_TOY_FORMS)
        a, b, c = rng.randint(11, 99), rng.randint(11, 99), rng.randint(2, 99)
        expression = form.format(a=a, b=b, c=c)
        question = f"Compute {expression}."
        tasks.append({"id": f"retool_toy-s{seed}-{i}", "env": "retool", "prompt": question, "question": question,
                      "answer": str(value_of(a, b, c)), "expression": expression, "source": "retool_toy"})
    return tasks


def optimal_toy_action(task: dict[str, Any], history: Sequence[tuple[str, str]] = ()) -> str:
    """Scripted policy for toy tasks: run the expression, then box the interpreter's answer."""
    for _action, observation in reversed(list(history)):
        match = _INTERPRETER_INTEGER.search(observation)
        if match:
            return f"The result is \\boxed{{{match.group(1)}}}."
    return f"<code>\nprint({task['expression']})\n</code>"


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    value = cfg.get(key, default) if cfg is not None else default
    return default if value is None else value


def retool_env_kwargs(env_cfg: Any) -> dict[str, Any]:
    """``ReToolEnv`` keyword arguments from an env config (``conf/env/retool.yaml``)."""
    sandbox_cfg = _cfg_get(env_cfg, "sandbox", {})
    sandbox_cfg = dict(sandbox_cfg.items()) if hasattr(sandbox_cfg, "items") else {}
    kind = sandbox_cfg.pop("kind", None) or "local"
    sandbox_kwargs = {k: v for k, v in sandbox_cfg.items() if v is not None}
    if kind != "fusion":
        sandbox_kwargs.pop("url", None)  # only the fusion client takes a url
    kwargs: dict[str, Any] = {"sandbox_kind": kind, "sandbox_kwargs": sandbox_kwargs}
    for key in ("max_turns", "code_timeout_s", "max_observation_chars", "persist_state", "verify_timeout_s",
                "fallback_last_number"):
        value = _cfg_get(env_cfg, key)
        if value is not None:
            kwargs[key] = value
    # tool_prompt_template: the ReTool instruction around the question ({prompt}); null = the question as is
    template = env_cfg.get("tool_prompt_template", PROMPT_TEMPLATE) if env_cfg is not None else PROMPT_TEMPLATE
    kwargs["prompt_template"] = template
    return kwargs


def make_retool_tasks(env_cfg: Any, seed: int = 0) -> list[dict[str, Any]]:
    """Training task records for ``env=retool``: ``make_retool_toy_tasks(num_tasks, seed)`` when
    ``env_cfg.train_data`` is ``"toy"`` (or unset), else the math records of that file
    (:func:`async_rl.data.math_data.make_math_tasks`)."""
    train_data = _cfg_get(env_cfg, "train_data", "toy")
    if str(train_data) == "toy":
        return make_retool_toy_tasks(int(_cfg_get(env_cfg, "num_tasks", 512)), seed)
    from async_rl.data.math_data import make_math_tasks

    return make_math_tasks(env_cfg, seed)


def _create_sandbox(env: "ReToolEnv") -> None:
    env.sandbox  # noqa: B018 - creates the shared sandbox now: an unusable one fails before the model loads


register_env_facts("retool", EnvFacts(make_tasks=make_retool_tasks, env_kwargs=lambda c: dict(retool_env_kwargs(c)),
                                      takes_max_turns=True, check_at_start=_create_sandbox,
                                      demonstrations=RETOOL_DEMONSTRATIONS))
