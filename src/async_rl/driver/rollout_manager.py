"""The rollout side of the driver (spec §1): :class:`RolloutManager` launches prompt groups, batches live
episodes into the engine, steps environments, and hands finished trajectories back.

Every env call runs on the manager's :class:`EnvCallPool` (persistent worker threads) under
``limits.env_timeout_s``, the calls of all episodes at once; a call that raises, returns garbage or times
out aborts its episode, never the run (:class:`EnvsKeepFailing` once ``max_consecutive_env_aborts``
trajectories in a row were aborted by env failures). ``wait_for_env=True`` (deterministic scheduler) resolves a tick's calls in submission order;
``wait_for_env=False`` (concurrent) collects them as they finish. Stuck threads are bounded by
``max_env_threads``.

Details: docs/driver.md (Environment calls; The loop, for the sampling seeds).
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

from async_rl.driver.episode import ChatFormatter, Episode, EpisodeLimits
from async_rl.driver.prompts import PromptStream
from async_rl.driver.trajectory import Trajectory
from async_rl.envs.base import Env
from async_rl.envs.calls import EnvCall, EnvCallPool, close_late_env, outcome_of
from async_rl.rollout.base import GenerationOutput, GenerationRequest, RolloutService, SamplingParams

# async mode, nothing to generate: how long one advance() may wait for the oldest env call before returning
_IDLE_ENV_WAIT_S = 0.005


@dataclass
class _Pending:
    """An env call in flight for ``episode`` (``episode.discarded``: nobody needs its result any more)."""

    episode: Episode
    call: EnvCall


@dataclass
class EnvCallCounters:
    """Cumulative env-call counts of a run (checkpointed, so a resumed run continues them)."""

    calls: int = 0  # env calls submitted (construct + reset + step + close)
    failed_calls: int = 0  # raised, returned an invalid value, or could not be run
    hung_calls: int = 0  # gave no answer within env_timeout_s
    aborted_trajectories: int = 0  # trajectories handed back aborted (env failure or generation abort)
    trajectories: int = 0  # trajectories handed back
    consecutive_env_aborts: int = 0  # trajectories aborted by an env failure since the last one that was not


class EnvsKeepFailing(RuntimeError):
    """Every recent trajectory was aborted by an env failure: the env is broken, not flaky (stop the run)."""


class RolloutManager:
    def __init__(
        self,
        engine: RolloutService,
        env_factory: Callable[[], Env],
        formatter: ChatFormatter,
        sampling: SamplingParams,
        limits: EpisodeLimits,
        prompts: PromptStream,
        seed: int,
        *,
        max_env_threads: int = 256,
        max_consecutive_env_aborts: int = 256,
    ):
        self.engine = engine
        self.env_factory = env_factory
        self.formatter = formatter
        self.sampling = sampling
        self.limits = limits
        self.prompts = prompts
        self.seed = seed
        self.group_size = 1
        self.max_env_threads = max_env_threads
        # a single failure aborts one trajectory; this many in a row, with no healthy one between, means the
        # env cannot work at all, and the run stops with the reason instead of relaunching prompts forever
        self.max_consecutive_env_aborts = max_consecutive_env_aborts
        self._last_env_abort: Optional[str] = None
        self.wait_for_env = True  # see the module docstring; the concurrent scheduler sets False
        self.episodes: dict[str, Episode] = {}  # live episodes by uid, in launch order (closing ones included)
        self.by_request: dict[str, Episode] = {}
        self.queued: list = []  # requests waiting for the engine's next batch
        self.generated_tokens = 0
        self.env_counters = EnvCallCounters()
        self._pool: Optional[EnvCallPool] = None
        self._pending: list[_Pending] = []  # env calls in flight, in submission order
        self._done: list[Trajectory] = []  # finished (and closed) trajectories not handed back yet

    # ------------------------------------------------------------------ env calls
    @property
    def pool(self) -> EnvCallPool:
        """The env worker pool, started on first use (and again after :meth:`release_env_threads`)."""
        if self._pool is None:
            self._pool = EnvCallPool(max_threads=self.max_env_threads, name="env-call-rollout")
        return self._pool

    def _submit(self, episode: Episode, kind: str, fn: Callable[[], Any]) -> None:
        self.env_counters.calls += 1
        self._pending.append(_Pending(episode, self.pool.submit(fn, self.limits.env_timeout_s, kind)))

    def _settle(self, block: bool) -> list[Trajectory]:
        """Resolve env calls: all of them, in submission order (``block``), or those that are over.

        Resolving one call may submit the episode's next one (construct -> reset, step -> close); those are
        resolved in the same call, so with ``block`` nothing is left in flight on return.
        """
        if not block and self._pool is not None:
            self._pool.rescue()  # calls queued behind busy workers get one (block: the waits do it)
        while self._pending:
            now = time.monotonic()
            pending, self._pending = self._pending, []
            waiting: list[_Pending] = []
            for item in pending:
                if block or item.call.done or item.call.refused is not None or item.call.past_deadline(now):
                    self._resolve(item)
                else:
                    waiting.append(item)
            progressed = len(waiting) < len(pending)
            self._pending = waiting + self._pending
            if not progressed and not block:
                break
        done, self._done = self._done, []
        return done

    def _check_env_health(self) -> None:
        if self.env_counters.consecutive_env_aborts >= self.max_consecutive_env_aborts:
            raise EnvsKeepFailing(
                f"the last {self.env_counters.consecutive_env_aborts} trajectories were all aborted by env "
                f"failures (last: {self._last_env_abort}); the env cannot work as configured: fix its settings "
                "(env.* on the command line; a server backend: is the server up?) and run again")

    def _resolve(self, item: _Pending) -> None:
        episode, call = item.episode, item.call
        outcome = outcome_of(call)  # waits until the call ends or its deadline passes
        if outcome.timed_out:
            self.env_counters.hung_calls += 1
            if call.kind == "construct":
                call.add_done_callback(close_late_env)  # built after all: do not leak it
        elif outcome.aborted:
            self.env_counters.failed_calls += 1
        if episode.discarded:
            if call.kind == "construct" and not outcome.aborted:
                episode.env = outcome.value
            if call.kind != "close" and episode.env is not None:
                self._submit(episode, "close", episode.env.close)
            return
        if call.kind == "construct":
            if outcome.aborted:
                episode.abort_construction(outcome)
            else:
                episode.env = outcome.value
                self._submit(episode, "reset", lambda env=episode.env, task=episode.task: env.reset(task))
                return
        elif call.kind == "reset":
            episode.apply_reset(outcome)
            if not episode.finished:
                self._queue_next(episode)
        elif call.kind == "step":
            episode.apply_step(outcome)
            if not episode.finished:
                self._queue_next(episode)
        else:  # close
            episode.apply_close(outcome)
        self._after_change(episode)

    def _after_change(self, episode: Episode) -> None:
        """Close a finished episode's env, or hand its trajectory back once closed."""
        if not episode.finished:
            return
        if episode.needs_close:
            self._submit(episode, "close", episode.env.close)
            return
        t = episode.trajectory
        del self.episodes[t.uid]
        c = self.env_counters
        c.trajectories += 1
        c.aborted_trajectories += int(t.aborted)
        if t.aborted and t.abort_reason != "generation aborted":
            c.consecutive_env_aborts += 1
            self._last_env_abort = t.abort_reason
        else:
            c.consecutive_env_aborts = 0
        self._done.append(t)

    # ------------------------------------------------------------------ launching
    @property
    def inflight_trajectories(self) -> int:
        return len(self.episodes)

    def launch_prompt(self) -> list[Trajectory]:
        """Start one prompt group of ``group_size`` episodes.

        The envs are built and reset on the pool; the episodes' first requests are queued when that is done
        (at the latest at the start of the next :meth:`advance`), and episodes that fail there come back
        from :meth:`advance`, aborted. Returns the trajectories finished so far that were not handed back
        yet (always none with ``wait_for_env``: the deterministic schedule must not depend on thread timing).
        """
        index, task = self.prompts.next()
        group_id = f"p{index}"
        for member in range(self.group_size):
            uid = f"{group_id}/r{member}"
            episode = Episode(None, task, self.formatter, self.sampling, self.limits, uid, group_id,
                              self.group_size, index, defer_close=True)
            self.episodes[uid] = episode
            self._submit(episode, "construct", self.env_factory)
        self._check_env_health()
        return [] if self.wait_for_env else self._settle(block=False)

    def _queue_next(self, episode: Episode) -> None:
        request = episode.next_request()
        if request is None:
            return
        turn_seed = zlib.crc32(f"{self.seed}/{request.request_id}".encode())
        request.sampling = dataclasses.replace(request.sampling, seed=turn_seed)
        self.by_request[request.request_id] = episode
        self.queued.append(request)

    # ------------------------------------------------------------------ generating
    @property
    def busy(self) -> bool:
        return self.engine.has_unfinished or bool(self.queued) or bool(self._pending)

    def advance(self, chunk_tokens: int) -> list[Trajectory]:
        """Generate up to ``chunk_tokens`` tokens; returns trajectories finished since the last call."""
        block = self.wait_for_env
        finished = self._settle(block)  # launches: envs built and reset, first requests queued
        if self.queued:
            # continuous batching: new prompts and next turns join the batch in flight at once
            self.engine.add_requests(self.queued)
            self.queued = []
        if self.engine.has_unfinished:
            for output in self.engine.step(chunk_tokens):
                self._on_output(output)
        elif self._pending and not block:
            self._pending[0].call.wait(_IDLE_ENV_WAIT_S)  # nothing to generate: do not spin on the env calls
        finished += self._settle(block)
        self._check_env_health()
        return finished

    def _on_output(self, output: GenerationOutput) -> None:
        episode = self.by_request.pop(output.request_id, None)
        if episode is None:  # a request dropped by discard_except / close, reported late by the engine
            return
        self.generated_tokens += len(output.token_ids)
        action = episode.take_output(output)
        if action is None:  # the generation was aborted: the episode ended
            self._after_change(episode)
            return
        self._submit(episode, "step", lambda env=episode.env, text=action: env.step(text))

    # ------------------------------------------------------------------ protocol steps
    def discard_except(self, keep_group_ids: set[str]) -> int:
        """Abort every live episode outside ``keep_group_ids`` (Li2SAO switch); returns how many.

        Their envs are closed on the pool (an env still busy in a call is closed once that call is over);
        nothing of them is handed back.
        """
        drop = [uid for uid, ep in self.episodes.items() if ep.trajectory.group_id not in keep_group_ids]
        drop_requests = {rid for rid, ep in self.by_request.items() if ep.trajectory.uid in drop}
        if drop_requests and self.engine.has_unfinished:
            self.engine.abort(list(drop_requests))
        self.queued = [r for r in self.queued if r.request_id not in drop_requests]
        for rid in drop_requests:
            self.by_request.pop(rid, None)
        busy = {id(item.episode) for item in self._pending}
        for uid in drop:
            episode = self.episodes.pop(uid)
            episode.discarded = True
            if id(episode) not in busy and episode.env is not None and not episode.env_closed:
                self._submit(episode, "close", episode.env.close)
        return len(drop)

    # ------------------------------------------------------------------ reporting and shutdown
    def env_metrics(self) -> dict[str, float]:
        """``rollout/`` counters of env calls (cumulative) and the pool's threads (now).

        ``rollout/env_leaked_threads``: worker threads still stuck in a call that timed out (bounded by
        ``max_env_threads``); ``perf/env_threads``: live worker threads (timing-dependent, hence ``perf/``).
        """
        c = self.env_counters
        pool = self._pool.stats() if self._pool is not None else {"threads": 0, "stuck_threads": 0}
        return {
            "rollout/env_calls": float(c.calls),
            "rollout/env_failed_calls": float(c.failed_calls),
            "rollout/env_hung_calls": float(c.hung_calls),
            "rollout/env_leaked_threads": float(pool["stuck_threads"]),
            "rollout/aborted_trajectories": float(c.aborted_trajectories),
            "rollout/aborted_ratio": c.aborted_trajectories / max(c.trajectories, 1),
            "perf/env_threads": float(pool["threads"]),
        }

    def release_env_threads(self, wait_s: float = 1.0) -> int:
        """Stop the pool's idle workers (a new pool starts on the next env call); call when no env call is in
        flight, e.g. at the end of a run. Returns the threads still alive (stuck in timed-out calls)."""
        if self._pending:
            raise RuntimeError("release_env_threads() with env calls in flight; advance() until they settle")
        pool, self._pool = self._pool, None
        return pool.shutdown(wait_s) if pool is not None else 0

    def close(self, wait_s: float = 1.0) -> int:
        """End the rollout: abort every live episode, close their envs (each under the timeout, all at once)
        and stop the worker threads. Returns the threads still stuck in env calls."""
        if self.by_request and self.engine.has_unfinished:
            self.engine.abort(list(self.by_request))
        self.by_request, self.queued = {}, []
        self.discard_except(set())
        self._settle(block=True)
        return self.release_env_threads(wait_s)

    # ------------------------------------------------------------------ checkpointing
    def settle_env_calls(self) -> list[Trajectory]:
        """Wait out every env call in flight (each under its timeout); returns the trajectories that
        finished. The concurrent scheduler calls it before :meth:`state_dict`, which needs none in flight."""
        return self._settle(block=True)

    def state_dict(self) -> dict:
        """Live episodes, queued requests and the engine's partial generations (call between chunks)."""
        if any(not item.episode.discarded for item in self._pending):
            raise RuntimeError("RolloutManager.state_dict() with env calls in flight; checkpoint between ticks")
        self._settle(block=True)  # closes of discarded episodes: nothing in the checkpoint depends on them
        if self._done:
            raise RuntimeError("RolloutManager.state_dict(): finished trajectories were not handed back yet")
        return {
            "group_size": self.group_size,
            "generated_tokens": self.generated_tokens,
            "env_counters": dataclasses.asdict(self.env_counters),
            "prompts": self.prompts.state_dict(),
            "episodes": [ep.state_dict() for ep in self.episodes.values()],
            "requests": {rid: ep.trajectory.uid for rid, ep in self.by_request.items()},
            "queued": [{"request_id": r.request_id, "prompt_ids": list(r.prompt_ids), "sampling": dict(vars(r.sampling))}
                       for r in self.queued],
            "engine": self.engine.export_inflight(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore; every env is rebuilt and replayed (under the timeout). An episode whose env fails there
        is aborted: its requests are dropped and its trajectory comes back from the next :meth:`advance`."""
        self.group_size = state["group_size"]
        self.generated_tokens = state["generated_tokens"]
        self.env_counters = EnvCallCounters(**state.get("env_counters", {}))
        self.prompts.load_state_dict(state["prompts"])
        self.episodes = {}
        self._pending, self._done = [], []
        broken: list[Episode] = []
        for ep_state in state["episodes"]:
            # replay calls are resume overhead, not rollout work: only their failures are counted
            construct = outcome_of(self.pool.submit(self.env_factory, self.limits.env_timeout_s, "construct"))
            if construct.aborted:
                self.env_counters.hung_calls += int(construct.timed_out)
                self.env_counters.failed_calls += int(not construct.timed_out)
                traj = Trajectory.from_dict(ep_state["trajectory"])
                ep = Episode(None, ep_state["task"], self.formatter, self.sampling, self.limits, traj.uid,
                             traj.group_id, traj.group_size, traj.prompt_index, pool=self.pool, defer_close=True)
                ep.trajectory = traj
                ep.abort_construction(construct)
            else:
                ep = Episode.restore(ep_state, construct.value, self.formatter, self.sampling, self.limits,
                                     pool=self.pool, defer_close=True)
            self.episodes[ep.trajectory.uid] = ep
            if ep.finished:
                broken.append(ep)
        self.by_request = {rid: self.episodes[uid] for rid, uid in state["requests"].items()}
        self.queued = [GenerationRequest(q["request_id"], q["prompt_ids"], SamplingParams(**q["sampling"]))
                       for q in state["queued"]]
        self.engine.import_inflight(state["engine"])
        if broken:
            dead = {rid for rid, ep in self.by_request.items() if ep.finished}
            if dead:
                self.engine.abort(list(dead))
            self.queued = [r for r in self.queued if r.request_id not in dead]
            self.by_request = {rid: ep for rid, ep in self.by_request.items() if rid not in dead}
            for ep in broken:
                self._after_change(ep)

    def live_group_ids(self) -> list[str]:
        """Group ids of live episodes, in launch order, each once."""
        return list(dict.fromkeys(ep.trajectory.group_id for ep in self.episodes.values()))
