"""Running env calls safely: a persistent worker pool with per-call timeouts (the call side of the env interface).

:func:`run_env_construct`, :func:`run_env_reset`, :func:`run_env_step`, :func:`run_env_close` (or
:meth:`EnvCallPool.submit`) run one call of an :class:`~async_rl.envs.base.Env` on a worker thread with a timeout and
turn an exception, a hang or an invalid return value into an *aborted* outcome: dropped, never a reward (spec §1).
The interface itself and the registry are :mod:`async_rl.envs.base`.

Details: docs/tasks.md (Environment interface), docs/driver.md.
"""

from __future__ import annotations

import _thread
import math
import numbers
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from async_rl.envs.base import Env, StepResult

__all__ = [
    "CallOutcome",
    "EnvAborted",
    "EnvCall",
    "EnvCallPool",
    "ResetOutcome",
    "StepOutcome",
    "close_late_env",
    "default_env_pool",
    "outcome_of",
    "run_env_close",
    "run_env_construct",
    "run_env_reset",
    "run_env_step",
    "step_outcome",
]


# --------------------------------------------------------------------------------------------------
# Running env calls safely: a persistent worker pool with per-call timeouts
# --------------------------------------------------------------------------------------------------


class EnvAborted(RuntimeError):
    """Raised by :meth:`StepOutcome.unwrap` when the environment failed (exception or timeout).

    It means "this trajectory is unusable", not "the policy did badly": do not turn it into a reward.
    """


@dataclass(frozen=True)
class StepOutcome:
    """Result of :func:`run_env_step`: either a :class:`StepResult` or an abort.

    Attributes:
        result: the step's result; None when aborted.
        aborted: True when the environment raised, hung past the timeout, or returned garbage.
        error: human-readable reason when aborted (exception type and message, or the timeout).
        timed_out: True when the abort was a timeout. The step may still be running in its worker
            thread; the environment's state is undefined, so close and discard it.
        elapsed_s: wall-clock seconds the caller waited.
    """

    result: StepResult | None
    aborted: bool
    error: str | None = None
    timed_out: bool = False
    elapsed_s: float = 0.0

    def unwrap(self) -> StepResult:
        """Return the result, or raise :class:`EnvAborted` carrying the error."""
        if self.aborted or self.result is None:
            raise EnvAborted(self.error or "environment step aborted")
        return self.result


@dataclass(frozen=True)
class ResetOutcome:
    """Result of :func:`run_env_reset`: the initial observation or an abort (same fields as StepOutcome)."""

    observation: str | None
    aborted: bool
    error: str | None = None
    timed_out: bool = False
    elapsed_s: float = 0.0

    def unwrap(self) -> str:
        """Return the observation, or raise :class:`EnvAborted` carrying the error."""
        if self.aborted or self.observation is None:
            raise EnvAborted(self.error or "environment reset aborted")
        return self.observation


@dataclass(frozen=True)
class CallOutcome:
    """Result of :func:`run_env_construct` / :func:`run_env_close` (same fields as StepOutcome).

    ``value`` is the new :class:`Env` for a construct and None for a close.
    """

    value: Any
    aborted: bool
    error: str | None = None
    timed_out: bool = False
    elapsed_s: float = 0.0


_T = TypeVar("_T")

# States of an EnvCall. Transitions happen under the pool's lock:
# queued -> running -> done, or queued -> cancelled (the caller gave up before a worker picked it up).
_QUEUED, _RUNNING, _DONE, _CANCELLED = "queued", "running", "done", "cancelled"


_MAX_RESCUE_SLICE_S = 0.05


def _rescue_slices(first_s: float):
    """Wait slices of a caller blocked on a call: short at first (a queued call gets a worker within
    ``first_s``), doubling up to 50 ms so that a long wait costs few wake-ups."""
    slice_s = first_s
    while True:
        yield slice_s
        slice_s = min(2 * slice_s, _MAX_RESCUE_SLICE_S)


class EnvCall:
    """One call submitted to an :class:`EnvCallPool`: poll it, wait for it, or give up on it.

    ``deadline`` (``time.monotonic()`` seconds; None = no limit) counts from submission, so time spent
    waiting for a free worker counts too: a caller never waits longer than the timeout it asked for.
    """

    __slots__ = ("kind", "fn", "timeout_s", "submitted", "started", "deadline", "state", "value", "error",
                 "timed_out", "abandoned", "refused", "_finished", "_callbacks", "_pool")

    def __init__(self, pool: "EnvCallPool", kind: str, fn: Callable[[], Any], timeout_s: float | None) -> None:
        self._pool = pool
        self.kind = kind
        self.fn = fn
        self.timeout_s = timeout_s
        self.submitted = time.monotonic()
        self.started: float | None = None  # when a worker began running it
        self.deadline = None if timeout_s is None else self.submitted + timeout_s
        self.state = _QUEUED
        self.value: Any = None
        self.error: BaseException | None = None
        self.timed_out = False  # the caller gave up at the deadline
        self.abandoned = False  # ... while the call was running: its thread is stuck until the call returns
        self.refused: str | None = None  # the pool could not take the call (closed, or every thread stuck)
        # a plain lock held until the call ends: the cheapest cross-thread "done" signal CPython has
        self._finished = _thread.allocate_lock()
        self._finished.acquire()
        self._callbacks: list[Callable[["EnvCall"], None]] = []

    @property
    def done(self) -> bool:
        """True once the call returned or raised (a cancelled call never runs, so it is never done)."""
        return self.state == _DONE

    def past_deadline(self, now: float | None = None) -> bool:
        return self.deadline is not None and (time.monotonic() if now is None else now) >= self.deadline

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the call is done or ``timeout_s`` passed; True when done."""
        if self.refused is not None:
            return False
        pool = self._pool
        deadline = None if timeout_s is None else time.monotonic() + max(timeout_s, 0.0)
        for slice_s in _rescue_slices(pool.rescue_after_s):
            # wait in slices: between them, calls stuck in the queue behind busy workers get a worker
            if deadline is not None:
                slice_s = min(slice_s, max(deadline - time.monotonic(), 0.0))
            if self._finished.acquire(timeout=slice_s):
                self._finished.release()  # leave it released: later waits return at once
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            pool.rescue()
        raise AssertionError("unreachable: _rescue_slices never ends")

    def finish(self) -> tuple[bool, Any, BaseException | None]:
        """Wait until done or the deadline, then ``(finished, value, exception)``; gives up at the deadline."""
        if self.refused is None:
            remaining = None if self.deadline is None else self.deadline - time.monotonic()
            if self.wait(remaining):
                return True, self.value, self.error
            if not self.give_up():  # it ended between the wait and the give-up
                return True, self.value, self.error
        return False, None, None

    def give_up(self) -> bool:
        """Stop waiting for the call (its deadline passed). False when it is already done (use the result).

        A queued call is cancelled (no worker will run it); a running one is *abandoned*: Python threads
        cannot be killed, so its worker stays busy until the env returns, and is counted as stuck.
        """
        return self._pool._give_up(self)

    def add_done_callback(self, callback: Callable[["EnvCall"], None]) -> None:
        """Run ``callback(call)`` when the call ends (in the worker thread), or now if it already has."""
        with self._pool._lock:
            if self.state != _DONE:
                self._callbacks.append(callback)
                return
        callback(self)


class EnvCallPool:
    """Persistent worker threads that run env calls (construct, reset, step, close) under timeouts.

    Why a pool: starting a thread per call costs 0.1-3 ms (far more than a toy env's step). Why few awake
    workers: waking one thread per call makes dozens of threads fight for the GIL over microsecond calls; so
    at most ``awake_limit`` workers take new calls, back to back, while the others sleep. Why it still never
    lets a hang block others: a call that waited ``rescue_after_s`` in the queue (every awake worker busy or
    stuck) gets another worker woken or started for it, up to ``max_threads`` -- any caller waiting on the
    pool triggers that (:meth:`rescue`), and a timed-out call's worker stops counting as awake at once.
    ``max_threads`` bounds the threads a misbehaving env can leak: once every thread is stuck in a timed-out
    call, new calls are refused at once (reported as an aborted call) instead of queueing behind them.
    Workers asleep for ``idle_exit_s`` exit.
    """

    def __init__(self, max_threads: int = 256, idle_exit_s: float = 30.0, name: str = "env-call",
                 awake_limit: int = 2, rescue_after_s: float = 0.002) -> None:
        for key, value in (("max_threads", max_threads), ("awake_limit", awake_limit)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EnvCallPool {key} must be an integer >= 1, got {value!r}")
        for key, value in (("idle_exit_s", idle_exit_s), ("rescue_after_s", rescue_after_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"EnvCallPool {key} must be > 0 seconds, got {value!r}")
        self.max_threads = max_threads
        self.awake_limit = awake_limit
        self.rescue_after_s = float(rescue_after_s)
        self.idle_exit_s = float(idle_exit_s)
        self.name = name
        self._lock = threading.Lock()
        self._work_ready = threading.Condition(self._lock)  # sleeping workers wait here
        self._jobs: deque[EnvCall] = deque()  # queued calls, oldest first (cancelled ones are skipped)
        self._threads: set[threading.Thread] = set()
        self._awake = 0  # workers running a call or looking for one (stuck ones excluded)
        self._sleeping = 0  # workers waiting on _work_ready
        self._wakeups = 0  # notifies sent that no sleeper has taken up yet
        self._stuck = 0  # workers running a call whose caller gave up on it
        self._running: dict[threading.Thread, EnvCall] = {}  # the call each awake, busy worker runs
        self._started_threads = 0
        self._closed = False
        # cumulative counters (read with stats())
        self.calls = 0
        self.hung_calls = 0  # callers gave up at the deadline (running or still queued)
        self.refused_calls = 0

    # ------------------------------------------------------------------ submitting
    def submit(self, fn: Callable[[], Any], timeout_s: float | None, kind: str = "call") -> EnvCall:
        """Start ``fn()`` on a worker; returns at once. Never raises for problems of ``fn``."""
        _check_timeout(timeout_s)
        call = EnvCall(self, kind, fn, timeout_s)
        with self._lock:
            self.calls += 1
            if self._closed:
                call.refused = "the env call pool is shut down"
            elif len(self._threads) >= self.max_threads and self._stuck >= len(self._threads):
                call.refused = (f"no free env worker: all {len(self._threads)} threads are stuck in env calls that "
                                "timed out and never returned; the env hangs (fix it, or raise max_threads)")
            if call.refused is not None:
                self.refused_calls += 1
                call.state = _CANCELLED
                return call
            self._jobs.append(call)
            if self._awake + self._wakeups < self.awake_limit:  # a notified sleeper is awake already
                self._wake_one_locked()
        return call

    def call(self, fn: Callable[[], _T], timeout_s: float | None, kind: str = "call"
             ) -> tuple[bool, _T | None, BaseException | None, str | None]:
        """Submit and wait: ``(finished, value, exception, refused_reason)``."""
        call = self.submit(fn, timeout_s, kind)
        finished, value, error = call.finish()
        return finished, value, error, call.refused

    def rescue(self) -> None:
        """Wake (or start) a worker for every call that has waited ``rescue_after_s`` in the queue."""
        with self._lock:
            self._rescue_locked(time.monotonic())

    def _rescue_locked(self, now: float) -> None:
        # only when every awake worker is held by a call running for rescue_after_s already: workers that are
        # merely waiting for the GIL or for the OS to schedule them will take the queued calls soon anyway
        if not self._jobs or self._wakeups:
            return
        held = sum(1 for c in self._running.values() if now - c.started >= self.rescue_after_s)
        if held < self._awake:
            return
        waiting = sum(1 for c in self._jobs if c.state == _QUEUED)
        for _ in range(waiting):
            if not self._wake_one_locked():
                break

    def _wake_one_locked(self) -> bool:
        if self._sleeping > self._wakeups:
            self._wakeups += 1
            self._work_ready.notify()
            return True
        if len(self._threads) < self.max_threads:
            self._awake += 1
            self._started_threads += 1
            worker = threading.Thread(target=self._work, name=f"{self.name}-{self._started_threads}", daemon=True)
            self._threads.add(worker)
            worker.start()
            return True
        return False

    # ------------------------------------------------------------------ workers
    def _work(self) -> None:
        while True:
            with self._lock:
                call = self._next_job_locked()
                if call is None:
                    return  # idle too long, or shut down
            try:
                call.value = call.fn()
            except BaseException as exc:  # noqa: BLE001 - report everything, including SystemExit from env code
                call.error = exc
            with self._lock:
                call.state = _DONE
                callbacks, call._callbacks = call._callbacks, []
                self._running.pop(threading.current_thread(), None)
                if call.abandoned:  # its caller gave up: back among the awake workers
                    self._stuck -= 1
                    self._awake += 1
            call._finished.release()
            for callback in callbacks:
                try:
                    callback(call)
                except Exception:  # noqa: BLE001 - a callback bug must not kill the worker
                    pass
            call.fn = None  # drop references to the env (closures) as soon as the call is over
            del call

    def _next_job_locked(self) -> EnvCall | None:
        """The next queued call (now running), sleeping while there is none; None when this worker leaves."""
        me = threading.current_thread()
        while True:
            while self._jobs:
                call = self._jobs.popleft()
                if call.state == _QUEUED:  # else cancelled: its caller gave up before it started
                    call.state = _RUNNING
                    call.started = time.monotonic()
                    self._running[me] = call
                    return call
            if self._closed:
                self._awake -= 1
                self._threads.discard(me)
                return None
            self._awake -= 1
            self._sleeping += 1
            while True:
                notified = self._work_ready.wait(timeout=self.idle_exit_s)
                if self._wakeups > 0:
                    self._wakeups -= 1
                    break
                if self._closed or not notified:  # shut down, or asleep for idle_exit_s
                    self._sleeping -= 1
                    self._threads.discard(me)
                    return None
            self._sleeping -= 1
            self._awake += 1

    def _give_up(self, call: EnvCall) -> bool:
        with self._lock:
            if call.state == _DONE:
                return False
            if call.timed_out or call.refused is not None:
                return True
            call.timed_out = True
            self.hung_calls += 1
            if call.state == _QUEUED:
                call.state = _CANCELLED  # a worker popping it will skip it
            else:
                call.abandoned = True
                self._stuck += 1
                self._awake -= 1  # no longer takes calls: queued ones get another worker
                self._running = {t: c for t, c in self._running.items() if c is not call}
                if self._jobs and self._awake + self._wakeups < self.awake_limit:
                    self._wake_one_locked()
            return True

    # ------------------------------------------------------------------ reporting and shutdown
    @property
    def num_threads(self) -> int:
        with self._lock:
            return len(self._threads)

    @property
    def stuck_threads(self) -> int:
        """Workers still running a call that timed out (leaked until the env returns; <= max_threads)."""
        with self._lock:
            return self._stuck

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"calls": self.calls, "hung_calls": self.hung_calls, "refused_calls": self.refused_calls,
                    "threads": len(self._threads), "stuck_threads": self._stuck}

    def shutdown(self, wait_s: float = 1.0) -> int:
        """Stop the workers: idle ones exit now, busy and stuck ones once their call returns (calls still
        queued are run first). Later :meth:`submit` calls are refused. Returns how many threads are still
        alive after waiting up to ``wait_s`` seconds for them (the stuck ones; daemon threads, they never
        block the interpreter's exit)."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
            self._work_ready.notify_all()
        deadline = time.monotonic() + max(wait_s, 0.0)
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        return sum(thread.is_alive() for thread in threads)


_DEFAULT_POOL: EnvCallPool | None = None
_DEFAULT_POOL_LOCK = threading.Lock()


def default_env_pool() -> EnvCallPool:
    """The process-wide pool behind :func:`run_env_step` and friends when no ``pool`` is given."""
    global _DEFAULT_POOL
    with _DEFAULT_POOL_LOCK:
        if _DEFAULT_POOL is None or _DEFAULT_POOL._closed:
            _DEFAULT_POOL = EnvCallPool(name="env-call-default")
        return _DEFAULT_POOL


def _describe_exception(exc: BaseException) -> str:
    """``"ValueError: message"`` plus the innermost frame, so logs point at the env's code."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _check_timeout(timeout_s: float | None) -> None:
    if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
                                      and timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")


def _validate_step_result(value: Any) -> str | None:
    """Return an error message when an env's ``step`` returned something unusable, else None."""
    if not isinstance(value, StepResult):
        return f"env.step returned {type(value).__name__}, expected StepResult"
    try:
        reward = float(value.reward)
    except (TypeError, ValueError):
        return f"env.step returned a non-numeric reward {value.reward!r}"
    if not math.isfinite(reward):
        # A NaN/inf reward would poison the advantage estimates of the whole batch.
        return f"env.step returned a non-finite reward {value.reward!r}"
    if not isinstance(value.observation, str):
        return f"env.step returned observation of type {type(value.observation).__name__}, expected str"
    if not isinstance(value.info, dict):
        return f"env.step returned info of type {type(value.info).__name__}, expected dict"
    if not _is_flag(value.done):
        return f"env.step returned done={value.done!r}, expected a bool"
    for key in _FLAG_INFO_KEYS:
        if key in value.info and not _is_flag(value.info[key]):
            return f"env.step returned info[{key!r}]={value.info[key]!r}, expected a bool"
    return None


# info keys the driver reads as flags (driver/episode.py); anything else in info is the env's own
_FLAG_INFO_KEYS = ("invalid_action", "success", "tool_executed")


def _is_flag(value: Any) -> bool:
    """A bool, numpy's bool, or an integer 0 or 1 of any integer type (``int``, ``np.int64``: what envs written
    against gym-style APIs return); a string like "no", a float or an array would be read as true or raise, so it
    aborts the trajectory instead."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return True
    return isinstance(value, numbers.Integral) and value in (0, 1)


def _failure(what: str, finished: bool, error: BaseException | None, timeout_s: float | None,
             refused: str | None) -> tuple[str, bool] | None:
    """``(message, timed_out)`` when a call did not produce a value, else None."""
    if refused is not None:
        return f"{what} not run: {refused}", False
    if not finished:
        return f"{what} timed out after {timeout_s:g} s", True
    if error is not None:
        return _describe_exception(error), False
    return None


def step_outcome(finished: bool, value: Any, error: BaseException | None, elapsed: float,
                 timeout_s: float | None, refused: str | None = None) -> StepOutcome:
    """One rule for every step runner: a timeout, an exception or an invalid value aborts."""
    failed = _failure("env.step", finished, error, timeout_s, refused)
    if failed is not None:
        return StepOutcome(None, True, failed[0], timed_out=failed[1], elapsed_s=elapsed)
    problem = _validate_step_result(value)
    if problem is not None:
        return StepOutcome(None, True, problem, elapsed_s=elapsed)
    return StepOutcome(value, False, None, elapsed_s=elapsed)


def reset_outcome(finished: bool, value: Any, error: BaseException | None, elapsed: float,
                  timeout_s: float | None, refused: str | None = None) -> ResetOutcome:
    failed = _failure("env.reset", finished, error, timeout_s, refused)
    if failed is not None:
        return ResetOutcome(None, True, failed[0], timed_out=failed[1], elapsed_s=elapsed)
    if not isinstance(value, str):
        return ResetOutcome(None, True, f"env.reset returned {type(value).__name__}, expected str", elapsed_s=elapsed)
    return ResetOutcome(value, False, None, elapsed_s=elapsed)


def construct_outcome(finished: bool, value: Any, error: BaseException | None, elapsed: float,
                      timeout_s: float | None, refused: str | None = None) -> CallOutcome:
    failed = _failure("env construction", finished, error, timeout_s, refused)
    if failed is not None:
        return CallOutcome(None, True, failed[0], timed_out=failed[1], elapsed_s=elapsed)
    if not isinstance(value, Env):
        return CallOutcome(None, True, f"the env factory returned {type(value).__name__}, expected an Env",
                           elapsed_s=elapsed)
    return CallOutcome(value, False, None, elapsed_s=elapsed)


def close_outcome(finished: bool, value: Any, error: BaseException | None, elapsed: float,
                  timeout_s: float | None, refused: str | None = None) -> CallOutcome:
    failed = _failure("env.close", finished, error, timeout_s, refused)
    if failed is not None:
        return CallOutcome(None, True, failed[0], timed_out=failed[1], elapsed_s=elapsed)
    return CallOutcome(None, False, None, elapsed_s=elapsed)


_OUTCOME_RULES: dict[str, Callable[..., Any]] = {
    "construct": construct_outcome, "reset": reset_outcome, "step": step_outcome, "close": close_outcome,
}


def outcome_of(call: EnvCall) -> StepOutcome | ResetOutcome | CallOutcome:
    """Wait for ``call`` (until done or its deadline, giving up then) and turn it into its outcome type.

    ``call.kind`` picks the rule: ``construct`` / ``close`` give a :class:`CallOutcome`, ``reset`` a
    :class:`ResetOutcome`, ``step`` a :class:`StepOutcome`.
    """
    finished, value, error = call.finish()
    return _OUTCOME_RULES[call.kind](finished, value, error, time.monotonic() - call.submitted, call.timeout_s,
                                     call.refused)


def _run(kind: str, fn: Callable[[], Any], timeout_s: float | None, pool: EnvCallPool | None):
    _check_timeout(timeout_s)
    return outcome_of((pool or default_env_pool()).submit(fn, timeout_s, kind))


def run_env_step(env: Env, action: str, timeout_s: float | None = 60.0, pool: EnvCallPool | None = None
                 ) -> StepOutcome:
    """Run ``env.step(action)`` on a worker of ``pool`` (default: :func:`default_env_pool`), waiting at
    most ``timeout_s`` seconds.

    Never raises for problems inside the environment: an exception, a timeout, or an invalid return
    value become ``StepOutcome(result=None, aborted=True, error=...)``. ``timeout_s=None`` waits forever.
    """
    return _run("step", lambda: env.step(action), timeout_s, pool)


def run_env_reset(env: Env, task: dict[str, Any], timeout_s: float | None = 60.0,
                  pool: EnvCallPool | None = None) -> ResetOutcome:
    """Like :func:`run_env_step` for ``env.reset(task)`` (resets can block too: game loading, servers)."""
    return _run("reset", lambda: env.reset(task), timeout_s, pool)


def run_env_construct(factory: Callable[[], Env], timeout_s: float | None = 60.0,
                      pool: EnvCallPool | None = None) -> CallOutcome:
    """Build an env with ``factory()`` under a timeout; ``outcome.value`` is the env.

    An env whose construction timed out may still be built later by the stuck worker: it is closed
    then, so its resources are not leaked.
    """
    _check_timeout(timeout_s)
    call = (pool or default_env_pool()).submit(factory, timeout_s, "construct")
    outcome = outcome_of(call)
    if outcome.timed_out:
        call.add_done_callback(close_late_env)
    return outcome


def run_env_close(env: Env, timeout_s: float | None = 60.0, pool: EnvCallPool | None = None) -> CallOutcome:
    """``env.close()`` under a timeout: a close that raises or hangs is reported, never raised or waited on."""
    return _run("close", env.close, timeout_s, pool)


def close_late_env(call: EnvCall) -> None:
    """Done-callback for a construct call that timed out: close the env it built after all."""
    env = call.value
    if isinstance(env, Env):
        try:
            env.close()
        except Exception:  # noqa: BLE001 - nobody is waiting for this env any more
            pass
