"""Single-turn math environment: the prompt is the question, the one action is the full answer."""

from __future__ import annotations

from typing import Any

from async_rl.envs.base import Env, StepResult, register_env
from async_rl.envs.demonstrations import MATH_DEMONSTRATIONS
from async_rl.envs.facts import EnvFacts, register_env_facts
from async_rl.rewards.math_reward import MathVerifier, grade_answer, reference_answer


@register_env("math")
class MathEnv(Env):
    """One question, one answer, reward 1.0 when the extracted answer equals the reference, else 0.0.

    Graded by :func:`async_rl.rewards.math_reward.grade_answer` (spec §6, strict: the last closed,
    non-empty ``\\boxed{}`` is the answer).

    Args:
        prompt_key: task field holding the prompt text (default ``"prompt"``).
        answer_key: task field holding the reference answer (default ``"answer"``).
        verify_timeout_s: hard limit of grading one answer (extraction and the symbolic check).
        verifier: a ``MathVerifier`` pool to use instead of the process-wide default.
        fallback_last_number: also accept the last number of a response without a usable box (spec §6's
            fallback; off by default and in every recipe, see docs/evaluation.md "The math grader").

    ``step`` info: ``extracted_answer`` (str | None), ``success`` (bool), ``invalid_action`` (True
    when no answer could be extracted at all, i.e. a format failure rather than a wrong answer).
    """

    max_turns = 1

    def __init__(
        self,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        verify_timeout_s: float = 5.0,
        verifier: MathVerifier | None = None,
        fallback_last_number: bool = False,
    ) -> None:
        if isinstance(verify_timeout_s, bool) or not isinstance(verify_timeout_s, (int, float)) \
                or not verify_timeout_s > 0:
            raise ValueError(f"verify_timeout_s must be a number of seconds > 0, got {verify_timeout_s!r}")
        if not isinstance(fallback_last_number, bool):
            raise ValueError(f"fallback_last_number must be true or false, got {fallback_last_number!r}")
        self.fallback_last_number = fallback_last_number
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        self.verify_timeout_s = verify_timeout_s
        self.verifier = verifier
        self._label: str | None = None
        self._done = True

    def reset(self, task: dict[str, Any]) -> str:
        for key in (self.prompt_key, self.answer_key):
            if key not in task:
                raise KeyError(
                    f"math task {task.get('id', '?')!r} has no {key!r} field (fields: {sorted(task)}); "
                    f"set prompt_key/answer_key to the dataset's column names"
                )
        prompt = task[self.prompt_key]
        if not isinstance(prompt, str):
            raise TypeError(
                f"math task prompt must be text, got {type(prompt).__name__}; "
                "apply the chat template before the env, or store the question text in the prompt field"
            )
        label = task[self.answer_key]
        if label is None or not str(label).strip():
            raise ValueError(f"math task {task.get('id', '?')!r} has an empty reference answer")
        self._label = reference_answer(label)
        self._done = False
        return prompt

    def step(self, action_text: str) -> StepResult:
        if self._label is None:
            raise RuntimeError("MathEnv.step called before reset")
        if self._done:
            raise RuntimeError("MathEnv episode is over (single turn); call reset for the next task")
        self._done = True
        predicted, correct = grade_answer(action_text, self._label, timeout_s=self.verify_timeout_s,
                                          verifier=self.verifier, fallback_last_number=self.fallback_last_number)
        return StepResult(
            observation="",
            reward=1.0 if correct else 0.0,
            done=True,
            info={"extracted_answer": predicted, "success": correct, "invalid_action": predicted is None},
        )


def math_env_kwargs(env_cfg: Any) -> dict[str, Any]:
    """``MathEnv`` keyword arguments from an env config (``conf/env/math.yaml``): the grader options
    ``verify_timeout_s`` and ``fallback_last_number`` when set (unset keys keep the strict defaults)."""
    kwargs: dict[str, Any] = {}
    for key in ("verify_timeout_s", "fallback_last_number"):
        value = env_cfg.get(key) if env_cfg is not None else None
        if value is not None:
            kwargs[key] = value
    return kwargs


def _math_tasks(env_cfg: Any, seed: int) -> list[dict[str, Any]]:
    from async_rl.data.math_data import make_math_tasks  # reads the data files: only when asked

    return make_math_tasks(env_cfg, seed)


register_env_facts("math", EnvFacts(make_tasks=_math_tasks, env_kwargs=math_env_kwargs,
                                    demonstrations=MATH_DEMONSTRATIONS))
