"""Env calls that raise or hang in construct / reset / step / close (issue 13, items 2 and 6).

What must hold: the run finishes; every failing trajectory comes back aborted (counted in the buffer and in
``rollout/`` metrics), never scored; a hung call delays no other episode (asserted on the order trajectories
come back, not on wall-clock time); threads are reused, bounded, and gone once the hangs end.

The rollout-manager tests use a scripted engine (no model): every live request gets a one-token answer per
``step``. Hangs wait on an Event that the test sets at the end, so no thread outlives the test.
"""

from __future__ import annotations

import threading
import time

import pytest

from async_rl.driver.buffer import TrajectoryBuffer
from async_rl.driver.episode import EpisodeLimits
from async_rl.driver.prompts import PromptStream
from async_rl.driver.rollout_manager import RolloutManager
from async_rl.envs.base import Env, StepResult, register_env
from async_rl.envs.calls import EnvCallPool, run_env_close, run_env_construct, run_env_step
from async_rl.rollout.base import GenerationOutput, SamplingParams

TIMEOUT_S = 1.0  # env_timeout_s of these tests: a hang is noticed after this long (a healthy call on a loaded
# 2-core machine must never take this long: 0.25 s left too little margin)
HANG_LIMIT_S = 30.0  # a hung call returns by itself after this long even if a test forgets to release it


def _threads_named(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


def _wait_until(predicate, limit_s: float = 10.0) -> bool:
    """Poll ``predicate`` (bounded); used only to let released threads wind down, never to time behaviour."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@pytest.fixture
def release():
    """Set at teardown: every hung fake env call returns then."""
    event = threading.Event()
    yield event
    event.set()


# ------------------------------------------------------------------------------------------------------
# the pool
# ------------------------------------------------------------------------------------------------------
def test_sequential_calls_reuse_one_thread_instead_of_starting_one_per_call():
    pool = EnvCallPool(name="env-test-reuse")
    seen = set()
    for _ in range(200):
        finished, value, error, refused = pool.call(lambda: threading.get_ident(), timeout_s=5)
        assert finished and error is None and refused is None
        seen.add(value)
    assert seen.isdisjoint({threading.get_ident()})  # off the caller's thread
    assert len(seen) == 1 and pool.stats()["threads"] == 1  # 200 calls, one worker started
    assert pool.shutdown(wait_s=5) == 0 and not _threads_named("env-test-reuse")


def test_a_hung_call_is_abandoned_counted_and_its_thread_recovers(release):
    pool = EnvCallPool(name="env-test-hang")
    hung = pool.submit(lambda: release.wait(HANG_LIMIT_S), timeout_s=TIMEOUT_S, kind="step")
    assert hung.finish() == (False, None, None) and hung.timed_out and hung.abandoned
    # the stuck worker does not stop other calls: a second worker serves them
    assert pool.call(lambda: "ok", timeout_s=5)[:2] == (True, "ok")
    assert pool.stats() == {"calls": 2, "hung_calls": 1, "refused_calls": 0, "threads": 2, "stuck_threads": 1}
    release.set()
    assert _wait_until(lambda: pool.stuck_threads == 0)  # the env returned: the thread is a normal worker again
    assert pool.shutdown(wait_s=5) == 0 and not _threads_named("env-test-hang")


def test_threads_are_bounded_once_every_worker_is_stuck(release):
    pool = EnvCallPool(max_threads=2, name="env-test-bound")
    for _ in range(2):
        assert pool.submit(lambda: release.wait(HANG_LIMIT_S), timeout_s=TIMEOUT_S).finish()[0] is False
    refused = run_env_step(_ScriptedEnv(), "x", timeout_s=5, pool=pool)  # refused at once, not after 5 s
    assert refused.aborted and not refused.timed_out and "no free env worker" in refused.error
    assert pool.stats()["threads"] == 2 and pool.stats()["refused_calls"] == 1
    release.set()
    assert _wait_until(lambda: pool.stuck_threads == 0)
    usable_again = run_env_step(_ScriptedEnv(), "x", timeout_s=5, pool=pool)
    assert not usable_again.aborted and usable_again.result.observation == "go on"
    assert pool.shutdown(wait_s=5) == 0


def test_a_call_that_times_out_in_the_queue_never_runs(release):
    pool = EnvCallPool(max_threads=1, name="env-test-queue")
    busy = pool.submit(lambda: release.wait(HANG_LIMIT_S), timeout_s=None)  # healthy but slow, nobody gives up
    ran = []
    queued = pool.submit(lambda: ran.append(1), timeout_s=TIMEOUT_S)
    assert queued.finish() == (False, None, None) and queued.timed_out and not queued.abandoned
    release.set()
    assert busy.wait(5) and busy.value is True
    pool.call(lambda: None, timeout_s=5)  # the worker has passed the cancelled call by now (FIFO)
    assert ran == [] and pool.stuck_threads == 0
    pool.shutdown(wait_s=5)


def test_construct_and_close_runners_report_instead_of_raising(release):
    assert run_env_construct(lambda: _ScriptedEnv(), timeout_s=5).value.__class__ is _ScriptedEnv
    bad = run_env_construct(lambda: _boom("constructor exploded"), timeout_s=5)
    assert bad.aborted and "RuntimeError: constructor exploded" in bad.error
    garbage = run_env_construct(lambda: "not an env", timeout_s=5)
    assert garbage.aborted and "returned str, expected an Env" in garbage.error

    built_late = []

    def slow_factory():
        release.wait(HANG_LIMIT_S)
        env = _ScriptedEnv()
        built_late.append(env)
        return env

    late = run_env_construct(slow_factory, timeout_s=TIMEOUT_S)
    assert late.aborted and late.timed_out and f"env construction timed out after {TIMEOUT_S:g} s" in late.error
    release.set()
    # the stuck constructor finished after all: its env is closed, not leaked
    assert _wait_until(lambda: built_late and built_late[0].closed)

    closing = run_env_close(_ScriptedEnv(close_fault="raise"), timeout_s=5)
    assert closing.aborted and "OSError: close exploded" in closing.error


# ------------------------------------------------------------------------------------------------------
# the rollout manager with scripted envs and a scripted engine
# ------------------------------------------------------------------------------------------------------
def _boom(message):
    raise RuntimeError(message)


class _ScriptedEnv(Env):
    """Three turns, reward 1 at the third; ``task["fault"]`` names a call that raises or hangs (a hung
    step hangs in the first turn). ``hanging_now`` / ``most_hanging_at_once`` count calls inside a hang."""

    max_turns = 3
    _count_lock = threading.Lock()
    hanging_now = 0
    most_hanging_at_once = 0

    def __init__(self, release: threading.Event | None = None, close_fault: str | None = None):
        self.release = release or threading.Event()
        self.close_fault = close_fault
        self.fault = None
        self.turn = 0
        self.closed = False

    def _misbehave(self, call: str) -> None:
        if self.fault == f"{call}_raise":
            raise RuntimeError(f"{call} exploded")
        if self.fault == f"{call}_hang":
            cls = _ScriptedEnv
            with cls._count_lock:
                cls.hanging_now += 1
                cls.most_hanging_at_once = max(cls.most_hanging_at_once, cls.hanging_now)
            self.release.wait(HANG_LIMIT_S)
            with cls._count_lock:
                cls.hanging_now -= 1

    def reset(self, task):
        self.fault, self.turn = task.get("fault"), 0
        self._misbehave("reset")
        return f"task {task['id']}"

    def step(self, action_text):
        self.turn += 1
        if self.fault in ("step_raise", "step_hang") and self.turn == 1:
            self._misbehave("step")
        return StepResult("go on", 1.0 if self.turn == 3 else 0.0, self.turn == 3, {"success": self.turn == 3})

    def close(self):
        self.closed = True
        if self.close_fault == "raise":
            raise OSError("close exploded")
        self._misbehave("close")


class _ScriptedEngine:
    """Every live request gets one token (id 5, text "go") per ``step``; enough to drive episodes."""

    def __init__(self):
        self.live = []

    @property
    def has_unfinished(self):
        return bool(self.live)

    def add_requests(self, requests):
        self.live += list(requests)

    def step(self, chunk_tokens):
        done, self.live = self.live, []
        return [GenerationOutput(r.request_id, r.prompt_ids, [5], [-0.5], [0], "stop", "go") for r in done]

    def abort(self, request_ids):
        ids = set(request_ids)
        dropped = [r for r in self.live if r.request_id in ids]
        self.live = [r for r in self.live if r.request_id not in ids]
        return [GenerationOutput(r.request_id, r.prompt_ids, [], [], [], "aborted", "") for r in dropped]

    def export_inflight(self):
        return []

    def import_inflight(self, states):
        assert not states


class _Formatter:
    end_token_id = None

    def prompt_ids(self, text):
        return [1, 2]

    def observation_ids(self, observation, model_closed_turn):
        return [3]


def _manager(tasks, factory, wait_for_env=True, max_env_threads=256):
    manager = RolloutManager(_ScriptedEngine(), factory, _Formatter(), SamplingParams(max_new_tokens=4),
                             EpisodeLimits(max_turns=3, max_response_tokens=64, env_timeout_s=TIMEOUT_S),
                             PromptStream(tasks, seed=0), seed=0, max_env_threads=max_env_threads)
    manager.wait_for_env = wait_for_env
    return manager


def _drain(manager, limit=200):
    """Advance until nothing is in flight; returns ``[(advance_index, trajectory), ...]`` in return order."""
    back = []
    for index in range(limit):
        if not manager.busy:
            return back
        back += [(index, t) for t in manager.advance(chunk_tokens=1)]
    raise AssertionError("the rollout never settled")


def _task_ids(pairs):
    return sorted(t.info["task_id"] for _, t in pairs)


FAULTS = ["reset_raise", "reset_hang", "step_raise", "step_hang", "close_raise", "close_hang"]


def test_every_faulty_call_aborts_only_its_trajectory_and_is_counted(release):
    built = []

    def factory():
        # the first two constructions fail (which episodes get them depends on thread order; counts do not)
        with lock:
            built.append(None)
            number = len(built)
        if number == 1:
            raise RuntimeError("constructor exploded")
        if number == 2:
            release.wait(HANG_LIMIT_S)
        return _ScriptedEnv(release)

    lock = threading.Lock()
    tasks = [{"id": i, "fault": fault} for i, fault in enumerate(FAULTS)] + [{"id": 10 + i} for i in range(6)]
    manager = _manager(tasks, factory)
    for _ in tasks:  # group size 1: one prompt per launch, 12 episodes
        assert manager.launch_prompt() == []
    back = [t for _, t in _drain(manager)]

    assert len(back) == 12 and not manager.episodes  # every episode came back: nothing hangs the driver
    reasons = sorted(t.abort_reason.split(":")[0] for t in back if t.aborted)
    # 2 constructions + 6 scripted faults, minus the scripted faults of the 2 episodes that never got an env
    aborted = [t for t in back if t.aborted]
    assert reasons.count("env construction failed") == 2
    never_built = {t.info["task_id"] for t in aborted if t.abort_reason.startswith("env construction")}
    expected_faulty = {i for i in range(6)} | never_built
    assert {t.info["task_id"] for t in aborted} == expected_faulty
    for t in aborted:
        fault = tasks[t.info["task_id"]].get("fault") if t.info["task_id"] < 6 else None
        if t.info["task_id"] in never_built:
            continue
        call, kind = fault.split("_")
        assert t.abort_reason.startswith({"reset": "reset failed", "step": "env step failed",
                                          "close": "env close failed"}[call]), t.abort_reason
        assert (f"timed out after {TIMEOUT_S:g} s" in t.abort_reason) == (kind == "hang")
        assert t.reward == 0.0 and not t.success  # an abort is never scored
    healthy = [t for t in back if not t.aborted]
    assert all(t.reward == 1.0 and t.num_turns == 3 for t in healthy)

    buffer = TrajectoryBuffer(capacity=32)
    for t in back:
        buffer.add(t)
    assert buffer.counters.aborted == len(aborted) and buffer.num_ready == 12 - len(aborted)
    metrics = manager.env_metrics()
    hangs = 1 + sum(f.endswith("hang") for f in FAULTS if tasks[FAULTS.index(f)]["id"] not in never_built)
    raises = 1 + sum(f.endswith("raise") for f in FAULTS if tasks[FAULTS.index(f)]["id"] not in never_built)
    assert metrics["rollout/env_hung_calls"] == hangs and metrics["rollout/env_failed_calls"] == raises
    assert metrics["rollout/aborted_trajectories"] == len(aborted)
    assert metrics["rollout/aborted_ratio"] == len(aborted) / 12
    assert metrics["rollout/env_leaked_threads"] == hangs  # still stuck until released, and reported

    release.set()
    assert _wait_until(lambda: manager.pool.stuck_threads == 0)
    assert manager.close(wait_s=5) == 0
    assert _wait_until(lambda: not _threads_named("env-call-rollout"))  # no thread left running


def _multi_turn_schedule(tasks, release, wait_for_env):
    manager = _manager(tasks, lambda: _ScriptedEnv(release), wait_for_env=wait_for_env)
    for _ in tasks:
        manager.launch_prompt()
    return manager


def test_in_the_deterministic_mode_hangs_overlap_and_leave_the_others_schedule_unchanged(release):
    healthy = [{"id": 10 + i} for i in range(4)]
    hanging = [{"id": i, "fault": "step_hang"} for i in range(6)]
    reference = _multi_turn_schedule(healthy, release, wait_for_env=True)
    clean = _drain(reference)
    assert reference.close(wait_s=5) == 0
    _ScriptedEnv.most_hanging_at_once = 0
    manager = _multi_turn_schedule(hanging + healthy, release, wait_for_env=True)
    faulty = _drain(manager)
    # the healthy episodes come back from the same advance() call as without any hang
    assert sorted((i, t.info["task_id"]) for i, t in faulty if not t.aborted) == \
        sorted((i, t.info["task_id"]) for i, t in clean)
    # the six hung steps (all in the first tick) were waited for together: all six come back from one call
    hung_at = {i for i, t in faulty if t.aborted}
    assert len([t for _, t in faulty if t.aborted]) == 6 and len(hung_at) == 1
    assert hung_at == {0}  # the tick of their first step; the healthy ones need two more (three turns)
    assert {i for i, _ in clean} == {2}
    assert manager.env_metrics()["rollout/env_hung_calls"] == 6
    # ... because they ran at the same time (one after the other, six hangs would cost six timeouts)
    assert _ScriptedEnv.most_hanging_at_once == 6
    release.set()
    assert _wait_until(lambda: manager.pool.stuck_threads == 0) and manager.close(wait_s=5) == 0


def test_in_the_concurrent_mode_a_hung_step_does_not_hold_up_the_other_episodes(release):
    manager = _multi_turn_schedule([{"id": 0, "fault": "step_hang"}] + [{"id": 10 + i} for i in range(4)],
                                   release, wait_for_env=False)
    manager.limits.env_timeout_s = HANG_LIMIT_S  # it will not time out during the test: only release ends it
    back = []
    for _ in range(2000):
        back += manager.advance(chunk_tokens=1)
        if len(back) == 4:
            break
    # all healthy episodes finished their three turns while episode 0 was still inside its first step
    assert _task_ids([(0, t) for t in back]) == [10, 11, 12, 13] and all(not t.aborted for t in back)
    [stuck] = manager.episodes.values()
    assert stuck.task["id"] == 0 and stuck.trajectory.num_turns == 1
    release.set()  # the step returns normally now and the episode goes on
    rest = _drain(manager, limit=2000)
    assert [t.info["task_id"] for _, t in rest] == [0] and not rest[0][1].aborted and rest[0][1].reward == 1.0
    assert manager.env_metrics()["rollout/env_hung_calls"] == 0
    assert manager.close(wait_s=5) == 0


def test_discarded_episodes_are_closed_once_their_call_is_over_and_never_come_back(release):
    closed = []

    class Recording(_ScriptedEnv):
        def close(self):
            closed.append(self.fault)
            super().close()

    manager = _manager([{"id": 0, "fault": "reset_hang"}, {"id": 1}], lambda: Recording(release),
                       wait_for_env=False)
    manager.limits.env_timeout_s = HANG_LIMIT_S
    manager.launch_prompt()
    manager.launch_prompt()
    by_task = {ep.task["id"]: ep for ep in manager.episodes.values()}
    for _ in range(2000):  # until episode 1 was reset (episode 0 stays inside its hung reset)
        manager.advance(chunk_tokens=1)
        if by_task[1].trajectory.prompt_ids:
            break
    # one engine step per advance() and three turns to go: episode 1 cannot have finished yet
    assert not by_task[1].finished and not by_task[0].trajectory.prompt_ids
    assert manager.discard_except(set()) == 2 and not manager.episodes
    assert "reset_hang" not in closed  # never closed under a call that is still running
    release.set()
    assert _drain(manager, limit=2000) == []  # discarded: nothing comes back
    assert sorted(closed, key=str) == [None, "reset_hang"]  # both closed once their calls were over
    assert manager.close(wait_s=5) == 0


# ------------------------------------------------------------------------------------------------------
# the real drivers on a tiny model with a toy env that hangs and raises
# ------------------------------------------------------------------------------------------------------
_RELEASE_TOY = threading.Event()


@register_env("test_faulty_keys")
class FaultyKeys(Env):
    """toy_keys whose key-3 tasks hang in their first step and key-5 tasks raise in close."""

    def __init__(self):
        from async_rl.envs.toy import ToyKeysEnv

        self.inner = ToyKeysEnv()
        self.max_turns = self.inner.max_turns
        self.key = None

    def reset(self, task):
        self.key = int(task["key"])
        return self.inner.reset(task)

    def step(self, action_text):
        if self.key == 3:
            _RELEASE_TOY.wait(HANG_LIMIT_S)
        return self.inner.step(action_text)

    def close(self):
        if self.key == 5:
            raise OSError("close exploded")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from async_rl.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=32, num_layers=1))


@pytest.mark.parametrize("scheduler", ["deterministic", "concurrent"])
def test_drivers_finish_with_faulty_envs_and_count_the_aborts(tiny_model, scheduler):
    import torch

    from async_rl.config import AlgorithmConfig
    from async_rl.assemble import RunSpec, build_concurrent_driver, build_deterministic_driver
    from async_rl.driver.driver import DriverConfig
    from async_rl.envs.toy import make_toy_tasks

    torch.set_num_threads(1)
    _RELEASE_TOY.clear()
    # 4 tasks: the first wave of 4 prompt groups (in-flight capacity 2 B = 16) holds each once
    tasks = [dict(task, key=key) for task, key in zip(make_toy_tasks("toy_keys", 4, 0), (3, 5, 0, 1))]
    spec = RunSpec(model_path=tiny_model, env_name="test_faulty_keys", tasks=tasks, max_new_tokens=6,
                   limits=EpisodeLimits(max_turns=2, max_response_tokens=40, env_timeout_s=TIMEOUT_S))
    algo = AlgorithmConfig(name="grpo", train_batch_trajectories=8, group_size=4, actor_lr=1e-3)
    build = build_deterministic_driver if scheduler == "deterministic" else build_concurrent_driver
    driver = build(algo, DriverConfig(total_steps=3, chunk_tokens=4), spec)
    threads_before = set(_threads_named("env-call-rollout"))
    try:
        history = driver.run()
    finally:
        _RELEASE_TOY.set()
    assert len(history) == 3
    last = history[-1]
    counters = driver.rollout.env_counters
    # 4 hung first steps (the key-3 group) and failing closes (key 5), counted whenever they happened
    assert counters.hung_calls >= 4 and counters.failed_calls > 0
    assert all(not t.aborted for group in driver.buffer._ready for t in group)  # never trained on
    # every aborted trajectory the buffer released was counted when it came back from the rollout
    assert driver.buffer.counters.aborted <= counters.aborted_trajectories
    if scheduler == "deterministic":  # in real time, when a group is released depends on thread timing
        assert last["rollout/env_hung_calls"] >= 4 and last["async/aborted"] >= 8
        assert driver.buffer.counters.aborted >= 8  # the whole key-3 and key-5 groups
    # nothing of this run is left running at the end (once the hung calls returned)
    assert _wait_until(lambda: not set(_threads_named("env-call-rollout")) - threads_before)


def test_an_env_that_can_never_be_built_stops_the_run_with_the_reason_instead_of_relaunching_forever():
    from async_rl.driver.rollout_manager import EnvsKeepFailing

    manager = _manager([{"id": i} for i in range(4)], lambda: _boom("no such game file"))
    manager.max_consecutive_env_aborts = 6
    with pytest.raises(EnvsKeepFailing, match="last 6 trajectories.*RuntimeError: no such game file"):
        for _ in range(10):  # a driver would relaunch prompts as long as trajectories come back
            manager.launch_prompt()
            _drain(manager)
    assert manager.env_counters.consecutive_env_aborts == 6
    manager.close(wait_s=5)


def test_one_healthy_trajectory_resets_the_run_of_failures(release):
    manager = _manager([{"id": 0, "fault": "reset_raise"}, {"id": 1}], lambda: _ScriptedEnv(release))
    manager.max_consecutive_env_aborts = 3
    # each epoch of the prompt stream holds the failing task once, so at most 2 fail in a row (end of one
    # epoch, start of the next): never 3
    for _ in range(6):
        manager.launch_prompt()
        _drain(manager)
    assert manager.env_counters.aborted_trajectories == 3 and manager.env_counters.consecutive_env_aborts <= 2
    manager.close(wait_s=5)


@pytest.mark.parametrize("done, info, accepted", [
    (True, {}, True), (False, {"success": True}, True), (1, {"invalid_action": 0}, True),
    (__import__("numpy").bool_(True), {"success": __import__("numpy").bool_(False)}, True),
    (__import__("numpy").int64(1), {"success": __import__("numpy").int32(0)}, True),  # numpy integers 0/1
    (__import__("numpy").int64(2), {}, False), (1.0, {}, False),  # another integer, or a float
    ("no", {}, False),  # a non-empty string reads as true: the episode would end as if the env said so
    (__import__("numpy").array([True, False]), {}, False),  # bool() of it raises inside the driver
    (2, {}, False), (None, {}, False),
    (False, {"success": "yes"}, False), (False, {"tool_executed": [1]}, False),
])
def test_done_and_the_flag_keys_of_info_must_be_bools(done, info, accepted):
    from async_rl.envs.base import StepResult
    from async_rl.envs.calls import step_outcome

    outcome = step_outcome(True, StepResult("obs", 0.0, done, info), None, 0.0, 1.0)
    assert outcome.aborted is not accepted
    if not accepted:
        assert "expected a bool" in outcome.error
