"""The concurrent scheduler (spec §1): the same driver pieces in real time, :class:`ConcurrentDriver`.

A rollout thread generates continuously and puts finished trajectories into the buffer at once; the
trainer, in the calling thread, takes a batch as soon as one is ready, trains, and publishes the new
weights *in flight* (applied at the engine's next token boundary). Staleness-aware admission launches a
prompt group only while untrained trajectories fit in ``(k + 1) * B`` and aborts live groups already past
the cap. An exception in the rollout thread is re-raised in the trainer (:class:`RolloutThreadError`);
every wait has a timeout.

Details: docs/driver.md (The concurrent scheduler (real time), Staleness-aware admission; The concurrent
scheduler under Checkpoint and resume).
"""

from __future__ import annotations

import threading
import time
import traceback
from pathlib import Path
from typing import Callable, ContextManager, Optional

from async_rl.driver.core import DriverConfig, RunCore, SwitchPhase
from async_rl.driver.learner import Learner
from async_rl.driver.rollout_manager import RolloutManager
from async_rl.driver.trajectory import Trajectory


class RolloutThreadError(RuntimeError):
    """The rollout thread failed; the message carries its traceback."""


class ConcurrentDriver(RunCore):
    def __init__(self, cfg: DriverConfig, learner: Learner, rollout: RolloutManager, *,
                 on_step: Optional[Callable[[dict], None]] = None, wait_timeout_s: float = 600.0,
                 staleness_aware: bool = True, checkpoint_dir: Optional[str | Path] = None):
        if cfg.synchronous:
            raise ValueError("the concurrent scheduler is asynchronous; use scheduler=deterministic for synchronous")
        super().__init__(cfg, learner, rollout, on_step=on_step, checkpoint_dir=checkpoint_dir)
        self.rollout.wait_for_env = False  # real time: env calls are collected as they finish, none waited out
        self.wait_timeout_s = wait_timeout_s
        self._lock = threading.Lock()  # guards rollout manager state and the switch phase
        self._ready = threading.Condition()  # guards the buffer; notified when trajectories arrive
        self._stop = threading.Event()
        self._error: Optional[str] = None
        self.staleness_aware = staleness_aware  # admission + stale aborts (False: the loop without them)
        self._training_batch = 0  # trajectories taken by the trainer and not yet published
        self.aborted_stale = 0  # live episodes aborted because their oldest token already exceeded the cap
        self.stale_wasted_tokens = 0

    # ------------------------------------------------------------------ rollout thread
    def _rollout_loop(self) -> None:
        try:
            while not self._stop.is_set():
                started = time.perf_counter()
                with self._lock:
                    finished: list[Trajectory] = []
                    # Li2SAO switch: the phase is read under _lock, so holding launches is an ordering, not a
                    # race for the lock
                    if not self.launch_held:
                        with self._ready:
                            while (self.rollout.inflight_trajectories + self.rollout.group_size <= self.max_inflight
                                   # trajectories a launch already finished (e.g. an env that failed
                                   # to start) are neither live nor buffered yet: count them too
                                   and self.buffer.has_room(self.rollout.inflight_trajectories + len(finished)
                                                            + self.rollout.group_size)
                                   and self._admits(self.rollout.group_size)):
                                finished += self.rollout.launch_prompt()
                    busy = self.rollout.busy
                    if busy:
                        finished += self.rollout.advance(self.cfg.chunk_tokens)
                    if finished:
                        # still under _lock: a finished trajectory is always either live or buffered, so the
                        # switch never misses one in transit (lock order: _lock, then _ready)
                        with self._ready:
                            for traj in finished:
                                self.intake(traj)
                            self._ready.notify_all()
                if busy:
                    self.time.rollout_busy_s += time.perf_counter() - started
                else:
                    time.sleep(0.005)  # nothing to do: buffer full or draining
        except BaseException:  # surfaced to the trainer, never swallowed
            self._error = traceback.format_exc()
            with self._ready:
                self._ready.notify_all()

    def _admits(self, new_trajectories: int) -> bool:
        """Staleness-aware admission (module docstring): untrained trajectories stay within (k + 1) batches."""
        if not self.staleness_aware:
            return True
        untrained = len(self.buffer) + self.rollout.inflight_trajectories + self._training_batch
        if untrained < self.batch_size:
            # what is underway cannot fill the next batch (e.g. aborted members left a group short): launch, or
            # the run would wait for ever
            return True
        return untrained + new_trajectories <= (self.cfg.staleness_cap + 1) * self.batch_size

    def _abort_stale_live(self) -> None:
        """Abort live groups holding a token whose lag already exceeds the cap (they can never be trained)."""
        if not self.staleness_aware:
            return
        version, cap = self.learner.policy_version, self.cfg.staleness_cap
        with self._lock:
            if self.switch is SwitchPhase.DRAINING:
                return  # the Li2SAO switch decides about every live group itself
            stale = {ep.trajectory.group_id for ep in self.rollout.episodes.values()
                     if ep.trajectory.max_lag(version) > cap}
            if not stale:
                return
            wasted = sum(ep.trajectory.num_model_tokens for ep in self.rollout.episodes.values()
                         if ep.trajectory.group_id in stale)
            keep = set(self.rollout.live_group_ids()) - stale
            with self._ready:
                self.aborted_stale += self.rollout.discard_except(keep)
                self.stale_wasted_tokens += wasted
                # members of those groups already buffered would wait for ever for the aborted ones: drop them
                self.buffer.discard_except(set(self.buffer.group_ids_oldest_first()) - stale)

    # ------------------------------------------------------------------ trainer (calling thread)
    def _wait_for_batch(self) -> Optional[list[Trajectory]]:
        """The next batch, or None once a stop is requested (the caller stops at this cut: checkpoints take
        ``_lock`` before ``_ready``, so not from inside this wait)."""
        deadline = time.monotonic() + self.wait_timeout_s
        with self._ready:
            while True:
                if self.stop_reason is not None:
                    return None
                if self._error is not None:
                    raise RolloutThreadError(f"the rollout thread failed:\n{self._error}")
                draining_done = self.switch is SwitchPhase.DRAINED
                batch = self.take_batch()
                if batch is not None:
                    self._training_batch = len(batch)  # still untrained for the admission rule until published
                    return batch
                if draining_done:
                    continue  # nothing of the kept job survived: the learner has switched, take a normal batch
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no batch of {self.batch_size} trajectories within {self.wait_timeout_s:.0f} s "
                        f"(ready {self.buffer.num_ready}, in flight {self.rollout.inflight_trajectories})")
                self._ready.wait(timeout=0.5)

    def _begin_switch(self) -> None:
        """Spec §4 in real time: keep the prefetched job, discard the rest, stop launching."""
        with self._lock, self._ready:
            self.begin_switch()

    def _finish_switch(self) -> None:
        """Wait for the kept job, then install n_s before the next generation request."""
        deadline = time.monotonic() + self.wait_timeout_s
        while True:
            if self._error is not None:
                raise RolloutThreadError(f"the rollout thread failed:\n{self._error}")
            with self._lock:
                if not self.kept_job_generating():
                    self.install_single_rollout()
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("the prefetched job did not finish in time during the Li2SAO switch")
            time.sleep(0.005)

    def run(self) -> list[dict]:
        thread = threading.Thread(target=self._rollout_loop, name="async_rl-rollout", daemon=True)
        thread.start()
        try:
            while self.learner.step < self.cfg.total_steps:
                batch = self._wait_for_batch()
                if batch is None:  # a stop was requested (request_stop) while waiting
                    self.stop_at_cut()
                result, weights = self.train(batch)
                if result.gate_opened:
                    self._begin_switch()
                    self._finish_switch()  # publication waits for the outstanding job (spec §4)
                if weights is not None:
                    # in-driver engine: applied by the rollout thread at its next token boundary (or at once
                    # between chunks); replicas: every replica pauses at a token boundary, loads, resumes
                    self.rollout.engine.update_weights(weights, self.learner.policy_version)
                self._training_batch = 0
                self._abort_stale_live()
                metrics = result.metrics
                metrics.update(self.step_metrics())
                metrics.update({"async/aborted_stale": float(self.aborted_stale),
                                "async/wasted_tokens": float(self.stale_wasted_tokens)})
                engine_metrics = getattr(self.rollout.engine, "metrics", None)
                if callable(engine_metrics):  # rollout replicas: liveness, aborted by failures, update latency
                    replica_metrics = engine_metrics()
                    # tokens lost on the replicas (aborts, failures) add to the stale aborts' tokens
                    replica_metrics["async/wasted_tokens"] += self.stale_wasted_tokens
                    metrics.update(replica_metrics)
                self.record(metrics)
                if self.checkpoint_due():  # also after a step that trained only the critic (LiSAO warm-up)
                    self.save_checkpoint()
                if self.stop_reason is not None and self.learner.step < self.cfg.total_steps:
                    self.stop_at_cut()
        finally:
            self._stop.set()
            thread.join(timeout=60)
            if not thread.is_alive():  # abort what is still live, close its envs, stop the env workers
                self.rollout.close()
        return self.history

    # ------------------------------------------------------------------ checkpoint and resume
    def _at_cut(self) -> ContextManager:
        return self._lock  # the rollout thread waits between two iterations while the cut is taken

    def state_dict(self) -> dict:
        """The run at a cut: taken by the trainer right after a publication, holding ``_lock`` (the rollout
        thread is between two iterations). Env calls still in flight are waited out first and the
        trajectories they finish go to the buffer, so the cut holds no half-done env step. Same layout as
        the deterministic driver's (``format`` 1, plus ``scheduler``). A resumed concurrent run continues the
        run (no trained step lost or repeated) but is not bit for bit (real time)."""
        with self._ready:
            for traj in self.rollout.settle_env_calls():
                self.intake(traj)
            # the weights of this version were handed to the engine just before the cut (in-driver engine:
            # applied at its next token boundary), so that is the version the resumed engine runs
            return {**self._run_state(self.learner.policy_version), "scheduler": "concurrent",
                    "aborted_stale": self.aborted_stale, "stale_wasted_tokens": self.stale_wasted_tokens}

    def load_state_dict(self, state: dict) -> None:
        self._load_run_state(state)
        self.aborted_stale = int(state.get("aborted_stale", 0))
        self.stale_wasted_tokens = int(state.get("stale_wasted_tokens", 0))
