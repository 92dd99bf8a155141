"""One episode as a state machine between the rollout engine and an environment (spec §1, multi-turn).

The scheduler asks each live :class:`Episode` for its next :class:`GenerationRequest` and hands every
finished :class:`GenerationOutput` back; the episode steps the environment and either finishes or appends
the observation tokens (:class:`ChatFormatter`, the chat template) and asks for the next turn. Every env
call runs on an :class:`EnvCallPool` worker under ``EpisodeLimits.env_timeout_s``; a crash, a hang, a
garbage return value or a failing ``close`` *aborts* the episode (excluded from training, never scored).
Blocking use: :meth:`Episode.begin` / :meth:`Episode.on_output`; split use (the rollout manager):
:meth:`Episode.take_output`, then :meth:`Episode.apply_step` / ``apply_reset`` / ``apply_close``.

Details: docs/driver.md (Environment calls: "Two ways to drive an episode", "Chat wrapping").
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from async_rl.driver.trajectory import Segment, Trajectory
from async_rl.envs.base import Env
from async_rl.envs.calls import (
    CallOutcome,
    EnvCallPool,
    ResetOutcome,
    StepOutcome,
    run_env_close,
    run_env_reset,
    run_env_step,
)
from async_rl.rollout.base import GenerationOutput, GenerationRequest, SamplingParams


def forced_turn_tokens(spec: dict[str, Any], uid: str) -> int:
    """Length of an episode's forced first turn (task key ``forced_first_turn``): lognormal with the given
    ``median`` and ``sigma`` (of log length), clipped to ``[min, max]``, drawn from a generator seeded by
    ``(seed, uid)``, so every episode -- each member of a group too -- draws its own, reproducibly.

    ``sigma = 1`` puts the 99th percentile at ``exp(2.326) = 10.2x`` the median (the papers' long tail)."""
    try:
        median, sigma = float(spec["median"]), float(spec.get("sigma", 1.0))
        low, high = int(spec.get("min", 1)), int(spec["max"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"task key forced_first_turn={spec!r}: needs median > 0, max >= min >= 1 (and optional "
                         f"sigma, min, seed): {exc}") from None
    if median <= 0 or sigma < 0 or not 1 <= low <= high:
        raise ValueError(f"task key forced_first_turn={spec!r}: needs median > 0, sigma >= 0, 1 <= min <= max")
    rng = random.Random(f"{spec.get('seed', 0)}:{uid}")
    return int(min(high, max(low, round(rng.lognormvariate(math.log(median), sigma)))))


@dataclass
class EpisodeLimits:
    max_turns: int = 4  # env turns per episode (the env's own max_turns also applies)
    max_response_tokens: int = 256  # model + observation tokens after the prompt
    env_timeout_s: float = 30.0  # any env call (construct, reset, step, close) slower than this aborts the episode
    # DAPO soft penalty on responses entering the final quarter of their window (spec §2); None: the algorithm's
    # algorithm.overlong_penalty decides (build.py fills it in), the one default
    overlong_penalty: Optional[bool] = None
    max_context_tokens: Optional[int] = None  # the model's context (prompt + response); a full one truncates

    def __post_init__(self) -> None:
        def whole(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if not whole(self.max_turns) or self.max_turns < 1:
            raise ValueError(f"env.max_turns={self.max_turns!r}: must be an integer >= 1")
        if not whole(self.max_response_tokens) or self.max_response_tokens < 1:
            raise ValueError(f"env.max_response_tokens={self.max_response_tokens!r}: must be an integer >= 1")
        timeout = self.env_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"env.env_timeout_s={timeout!r}: must be a positive, finite number of seconds")
        if self.overlong_penalty is not None and not isinstance(self.overlong_penalty, bool):
            raise ValueError(f"overlong_penalty={self.overlong_penalty!r}: must be true, false or None (the algorithm's)")
        if self.max_context_tokens is not None and (not whole(self.max_context_tokens) or self.max_context_tokens < 2):
            raise ValueError(f"max_context_tokens={self.max_context_tokens!r}: must be an integer >= 2 or None")


class _TokenCache:
    """Bounded LRU map text -> token ids, for texts that repeat (prompts of a group, stock observations).

    Texts longer than ``max_chars`` are not cached: they rarely repeat and would pin memory.
    """

    def __init__(self, max_entries: int = 4096, max_chars: int = 2048):
        self.max_entries = max_entries
        self.max_chars = max_chars
        self._ids: OrderedDict[Any, tuple[int, ...]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: Any, text: str, tokenize) -> list[int]:
        if len(text) > self.max_chars:
            return list(tokenize())
        ids = self._ids.get(key)
        if ids is not None:
            self._ids.move_to_end(key)
            self.hits += 1
            return list(ids)  # a fresh list: trajectories own (and may extend) their token lists
        self.misses += 1
        ids = tuple(tokenize())
        self._ids[key] = ids
        if len(self._ids) > self.max_entries:
            self._ids.popitem(last=False)
        return list(ids)


@dataclass(frozen=True)
class ChatFrame:
    """How a model's chat template wraps an environment observation between two assistant turns, read off the
    template itself (:meth:`from_tokenizer`), never assumed: ChatML (Qwen, SmolLM2), Llama 3 and others differ.

    ``turn_close`` is what the template writes after an assistant message's text (ChatML: ``<|im_end|>`` and a
    newline);
    ``end_token`` the special token it starts with, the one the model emits to end its turn (the rollout's stop
    token; None when the close starts with none); ``user_open`` / ``user_close`` surround the observation in a
    user turn, ``user_close`` including the generation prompt of the next assistant turn.
    """

    turn_close: str
    end_token: Optional[str]
    user_open: str
    user_close: str

    _ASSISTANT = "ASSISTANT_TEXT_MARK_31d7"
    _OBSERVATION = "OBSERVATION_TEXT_MARK_31d7"

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "ChatFrame":
        """Render ``[user, assistant A]`` and ``[user, assistant A, user O]`` + generation prompt: what follows
        ``A`` in the first is the turn's close; what follows it in the second is that close, then the observation's
        frame around ``O``. Only the text after ``A`` must agree: templates that render an assistant turn
        differently once it is no longer the last (Qwen3 drops earlier ``<think>`` blocks) still frame
        observations the same way, and the rollout never re-renders earlier turns (it appends tokens)."""
        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": cls._ASSISTANT}]
        try:
            closed = tokenizer.apply_chat_template(base, tokenize=False)
            extended = tokenizer.apply_chat_template(base + [{"role": "user", "content": cls._OBSERVATION}],
                                                     tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - a template error, named below with its fix
            raise ValueError(f"the tokenizer's chat template cannot render a multi-turn chat ({exc}); multi-turn "
                             "tasks need a chat model (tokenizer_config.json with a chat_template)") from exc
        after = extended[extended.rindex(cls._ASSISTANT) + len(cls._ASSISTANT):] if cls._ASSISTANT in extended else ""
        turn_close = closed[closed.rindex(cls._ASSISTANT) + len(cls._ASSISTANT):] if cls._ASSISTANT in closed else None
        if turn_close is None or not after.startswith(turn_close) or after.count(cls._OBSERVATION) != 1:
            raise ValueError("the tokenizer's chat template closes an assistant turn differently once a user turn "
                             "follows it (or drops the turn's text), so observations cannot be appended token by "
                             "token; multi-turn tasks need a template that ends an assistant turn the same way "
                             "wherever it stands")
        user_open, user_close = after[len(turn_close):].split(cls._OBSERVATION)
        specials = sorted((t for t in getattr(tokenizer, "all_special_tokens", []) +
                           list(getattr(tokenizer, "added_tokens_encoder", {}) or {}) if t), key=len, reverse=True)
        end_token = next((t for t in specials if turn_close.startswith(t)), None)
        return cls(turn_close, end_token, user_open, user_close)

    def observation_text(self, observation: str, model_closed_turn: bool) -> str:
        """The text appended after a model turn: the rest of the turn's close (all of it when the model did not
        emit ``end_token``), then the observation as a user turn and the next assistant turn's opening."""
        close = self.turn_close
        if model_closed_turn and self.end_token is not None:
            close = close[len(self.end_token):]
        return f"{close}{self.user_open}{observation}{self.user_close}"


class ChatFormatter:
    """Turns prompts and observations into token ids with the tokenizer's chat template.

    Both conversions are pure functions of their text, so results are cached (``_TokenCache``): the
    ``group_size`` members of a prompt group share one chat-template call, and an observation text that
    repeats ("Invalid action.", "The key is 7.") is tokenised once. The observation's frame comes from the
    template (:class:`ChatFrame`), read once when the formatter is made.
    """

    def __init__(self, tokenizer, system_prompt: Optional[str] = None):
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        try:
            self._frame: Optional[ChatFrame] = ChatFrame.from_tokenizer(tokenizer)
            self._frame_error: Optional[ValueError] = None
        except ValueError as exc:  # raised again where an observation needs the frame (multi-turn tasks)
            self._frame, self._frame_error = None, exc
        self._prompt_cache = _TokenCache()
        self._observation_cache = _TokenCache()

    @property
    def frame(self) -> ChatFrame:
        """The observation frame; raises the template's one-line error when it has none (call it at assembly
        for a multi-turn task, so the run stops before training)."""
        if self._frame is None:
            raise self._frame_error
        return self._frame

    @property
    def end_token_id(self) -> Optional[int]:
        """Id of the token that ends an assistant turn (the rollout's stop token): the frame's end token, else
        the tokenizer's eos (a template with no turn structure: single-turn tasks stop there), else None."""
        end = self._frame.end_token if self._frame is not None else None
        if end is not None:
            return self.tokenizer.convert_tokens_to_ids(end)
        return getattr(self.tokenizer, "eos_token_id", None)

    def prompt_ids(self, text: str) -> list[int]:
        return self._prompt_cache.get(text, text, lambda: self._render_prompt(text))

    def _render_prompt(self, text: str) -> list[int]:
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
        messages.append({"role": "user", "content": text})
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def observation_ids(self, observation: str, model_closed_turn: bool) -> list[int]:
        """Tokens appended after a model turn: close it if the model did not, then the user observation."""
        # the whole wrapped text is tokenised at once (not prefix + obs + suffix separately): BPE merges
        # across the boundaries must match what a chat template would give
        text = self.frame.observation_text(observation, model_closed_turn)
        return self._observation_cache.get(
            (observation, model_closed_turn), observation,
            lambda: self.tokenizer(text, add_special_tokens=False)["input_ids"])


class Episode:
    """A live episode. ``trajectory`` is complete once :attr:`finished` is True (and, with
    ``defer_close``, once the caller applied the close: :attr:`needs_close` is False)."""

    def __init__(
        self,
        env: Optional[Env],
        task: dict[str, Any],
        formatter: ChatFormatter,
        sampling: SamplingParams,
        limits: EpisodeLimits,
        uid: str,
        group_id: str,
        group_size: int,
        prompt_index: int,
        *,
        pool: Optional[EnvCallPool] = None,
        defer_close: bool = False,
    ):
        self.env = env  # None until the caller built it (the rollout manager constructs envs off-thread)
        self.task = task
        self.formatter = formatter
        self.sampling = sampling
        self.limits = limits
        self.pool = pool  # worker pool of the blocking calls (None: the process-wide default pool)
        self.defer_close = defer_close
        self.finished = False
        self.env_closed = False
        self.discarded = False  # dropped by a protocol step (Li2SAO switch): its trajectory is never handed back
        self._awaiting_output = False
        self.actions: list[str] = []  # action texts sent to the env, to replay it on resume
        self.trajectory = Trajectory(uid=uid, group_id=group_id, prompt_index=prompt_index, prompt_ids=[],
                                     group_size=group_size, info={"task_id": task.get("id")})
        # a task may force the first turn's length (a long-tailed workload, benchmarks/group_vs_single.py)
        self.forced_first_turn: Optional[int] = None
        if task.get("forced_first_turn") is not None:
            self.forced_first_turn = forced_turn_tokens(task["forced_first_turn"], uid)
            self.trajectory.info["forced_first_turn_tokens"] = self.forced_first_turn

    @property
    def needs_close(self) -> bool:
        """Finished, but its env has not been closed yet (``defer_close``: the caller's job)."""
        return self.finished and self.env is not None and not self.env_closed

    # ------------------------------------------------------------------ blocking drive
    def begin(self) -> None:
        """Reset the env (blocking, under the timeout) and build the prompt."""
        self.apply_reset(run_env_reset(self.env, self.task, timeout_s=self.limits.env_timeout_s, pool=self.pool))

    def on_output(self, output: GenerationOutput) -> None:
        """Record a finished generation and step the environment (blocking, under the timeout)."""
        action = self.take_output(output)
        if action is not None:
            self.apply_step(run_env_step(self.env, action, timeout_s=self.limits.env_timeout_s, pool=self.pool))

    # ------------------------------------------------------------------ split drive
    def apply_reset(self, outcome: ResetOutcome) -> None:
        if outcome.aborted:
            self._abort(f"reset failed: {outcome.error}")
            return
        self.trajectory.prompt_ids = self.formatter.prompt_ids(outcome.observation)

    def abort_construction(self, outcome: CallOutcome) -> None:
        """The env could not be built: the episode ends aborted before it began."""
        self._abort(f"env construction failed: {outcome.error}")

    def next_request(self) -> Optional[GenerationRequest]:
        """The request for the next model turn, or None when finished / already waiting."""
        if self.finished or self._awaiting_output:
            return None
        t = self.trajectory
        budget = self.limits.max_response_tokens - len(t.response_ids)
        if self.limits.max_context_tokens is not None:
            # a context the model cannot extend ends the episode (truncated) instead of failing the batch
            budget = min(budget, self.limits.max_context_tokens - len(t.prompt_ids) - len(t.response_ids))
        if budget <= 0:
            self._finish(reward=0.0, truncated=True)
            return None
        sampling = self.sampling
        if self.forced_first_turn is not None and t.num_turns == 0:
            # exactly this many tokens: no eos, no stop string ends the turn early
            sampling = SamplingParams(**{**vars(sampling), "max_new_tokens": self.forced_first_turn,
                                         "ignore_eos": True, "stop_strings": (), "stop_token_ids": ()})
        if sampling.max_new_tokens > budget:
            sampling = SamplingParams(**{**vars(sampling), "max_new_tokens": budget})
        self._awaiting_output = True
        return GenerationRequest(request_id=f"{t.uid}/turn{t.num_turns}", prompt_ids=t.prompt_ids + t.response_ids,
                                 sampling=sampling)

    def take_output(self, output: GenerationOutput) -> Optional[str]:
        """Record a finished generation; returns the action text to step the env with, or None when the
        episode ended instead (the generation was aborted)."""
        self._awaiting_output = False
        t = self.trajectory
        if output.finish_reason == "aborted":
            self._abort("generation aborted")
            return None
        t.segments.append(Segment("model", list(output.token_ids), list(output.logprobs), list(output.versions),
                                  t.num_turns))
        t.num_turns += 1
        self.actions.append(output.text)
        return output.text

    def apply_step(self, outcome: StepOutcome) -> None:
        """Apply the env's answer to the last action: finish, or append the observation for the next turn."""
        t = self.trajectory
        if outcome.aborted:
            self._abort(f"env step failed: {outcome.error}")
            return
        result = outcome.result
        turn = t.num_turns - 1
        t.turn_rewards.append(float(result.reward))
        t.turn_dones.append(bool(result.done))
        t.turn_invalid.append(bool(result.info.get("invalid_action", False)))
        if result.info.get("tool_executed"):  # an env that runs tools (ReTool) says so per step
            t.info["tool_calls"] = t.info.get("tool_calls", 0) + 1
        if result.done:
            t.success = bool(result.info.get("success", result.reward > 0))
            self._finish(reward=sum(t.turn_rewards), truncated=False)
            return
        if t.num_turns >= min(self.limits.max_turns, getattr(self.env, "max_turns", self.limits.max_turns)):
            self._finish(reward=sum(t.turn_rewards), truncated=True)
            return
        last_model = t.segments[-1].token_ids
        closed = self.formatter.end_token_id is not None and last_model[-1:] == [self.formatter.end_token_id]
        obs_ids = self.formatter.observation_ids(result.observation, closed)
        context_full = (self.limits.max_context_tokens is not None and len(t.prompt_ids) + len(t.response_ids)
                        + len(obs_ids) >= self.limits.max_context_tokens)
        if context_full or len(t.response_ids) + len(obs_ids) >= self.limits.max_response_tokens:
            self._finish(reward=sum(t.turn_rewards), truncated=True)
            return
        t.segments.append(Segment("env", obs_ids, turn=turn))

    def apply_close(self, outcome: CallOutcome) -> None:
        """Record the env's close. A close that raised or hung aborts the trajectory (if nothing did before)."""
        self.env_closed = True
        if outcome.aborted:
            self.trajectory.info["env_close_error"] = outcome.error
            if not self.trajectory.aborted:
                t = self.trajectory
                # the env's verdict is kept for diagnostics only: an aborted trajectory is never scored
                t.info["reward_before_abort"], t.info["success_before_abort"] = t.reward, t.success
                t.reward, t.success = 0.0, False
                t.aborted, t.abort_reason = True, f"env close failed: {outcome.error}"

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        return {"task": self.task, "trajectory": self.trajectory.to_dict(), "actions": list(self.actions),
                "awaiting_output": self._awaiting_output}

    @classmethod
    def restore(cls, state: dict, env: Env, formatter: ChatFormatter, sampling: SamplingParams,
                limits: EpisodeLimits, *, pool: Optional[EnvCallPool] = None, defer_close: bool = False
                ) -> "Episode":
        """Rebuild a live episode; the env is replayed through the recorded actions (envs are seeded and
        deterministic, so it reaches the same state). Replay calls run under the timeout like any other:
        a replay that fails leaves the episode finished and aborted (``abort_reason`` says so)."""
        traj = Trajectory.from_dict(state["trajectory"])
        episode = cls(env, state["task"], formatter, sampling, limits, traj.uid, traj.group_id, traj.group_size,
                      traj.prompt_index, pool=pool, defer_close=defer_close)
        episode.trajectory = traj
        episode.actions = list(state["actions"])
        episode._awaiting_output = state["awaiting_output"]
        replay = run_env_reset(env, episode.task, timeout_s=limits.env_timeout_s, pool=pool)
        failure = replay.error if replay.aborted else None
        for action in episode.actions:
            if failure is not None:
                break
            step = run_env_step(env, action, timeout_s=limits.env_timeout_s, pool=pool)
            failure = step.error if step.aborted else None
        if failure is not None:
            episode._awaiting_output = False
            episode._abort(f"env replay on resume failed: {failure}")
        return episode

    # ------------------------------------------------------------------ endings
    def _finish(self, reward: float, truncated: bool) -> None:
        if self.limits.overlong_penalty:
            from async_rl.rewards.math_reward import overlong_penalty

            # spec §2: "responses entering the final quarter of the context window". The window is the part of
            # the context the response may fill: max_response_tokens, capped by what the model's context leaves
            # after the prompt; every token in it counts, model and observation (a tool output spends it too).
            # The prompt is left out: with it, a prompt longer than 3x the budget would penalise every response
            t = self.trajectory
            window = self.limits.max_response_tokens
            if self.limits.max_context_tokens is not None:
                window = max(1, min(window, self.limits.max_context_tokens - len(t.prompt_ids)))
            reward += overlong_penalty(len(t.response_ids), window)
        self.trajectory.reward = float(reward)
        self.trajectory.truncated = truncated
        self._end()

    def _abort(self, reason: str) -> None:
        self.trajectory.aborted = True
        self.trajectory.abort_reason = reason
        self._end()

    def _end(self) -> None:
        self.finished = True
        if not self.defer_close and self.needs_close:
            # blocking drive: close now, under the timeout (a hung close is abandoned, never waited out)
            self.apply_close(run_env_close(self.env, timeout_s=self.limits.env_timeout_s, pool=self.pool))
