"""The concurrent scheduler: the same driver pieces in real time.

A rollout thread generates continuously (launch prompt groups while capacity allows, one chunk at a time,
finished trajectories into the buffer at once). The trainer runs in the calling thread: it takes a batch as
soon as one is ready, trains, and publishes the new weights to the engine *in flight* (the engine applies
them at the next token boundary; running sequences keep their prefix). Torch releases the GIL in its
kernels, so generation and training overlap on a multi-core CPU or a GPU.

Staleness-aware admission (spec §1 cap k, in the spirit of AReaL's ``max_head_offpolicyness`` and verl's
``staleness_threshold``): a prompt group is launched only while the trajectories not yet trained -- live, in the
buffer, and the batch the trainer is training -- plus the new group fit in ``(k + 1) * B``. A trajectory launched
under version ``v`` then has at most ``k`` batches ahead of it, so its tokens are trained with lag <= k instead
of being generated and then dropped. When the untrained trajectories cannot fill one batch (aborted members
leave groups short), launching is always allowed, so the rule never stalls the run. After each publication,
live episodes whose oldest recorded token already lags by more than ``k`` are aborted with their whole group
(the buffer would drop the group anyway):
``async/aborted_stale`` counts them, ``async/wasted_tokens`` counts the model tokens thrown away by stale aborts
(plus, with replicas, those lost to aborts and replica failures).

The engine is the in-driver ``HFRolloutEngine`` (``trainer.workers=local``) or the rollout replicas
(``trainer.workers=ray``: :class:`async_rl.rollout.client.ReplicaPool`, the same interface); the loop calls
both through that interface, and reads the engine's own metrics only where it has some (replica counters).

Failure handling: an exception in the rollout thread is re-raised in the trainer with its traceback; the
trainer never waits without a timeout, so a dead rollout cannot deadlock the driver.
"""

from __future__ import annotations

import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

from async_rl.driver.buffer import TrajectoryBuffer
from async_rl.driver.checkpoint import prune_checkpoints, resume_checkpoint, write_checkpoint
from async_rl.driver.driver import (
    DriverConfig,
    RunStats,
    choose_prefetched_job,
    load_run_state,
    run_state,
    take_last_bootstrap_batch,
    weights_for_engine,
)
from async_rl.driver.learner import Learner
from async_rl.driver.rollout_manager import RolloutManager
from async_rl.driver.trajectory import Trajectory


class RolloutThreadError(RuntimeError):
    """The rollout thread failed; the message carries its traceback."""


class ConcurrentDriver:
    def __init__(self, cfg: DriverConfig, learner: Learner, rollout: RolloutManager, *,
                 on_step: Optional[Callable[[dict], None]] = None, wait_timeout_s: float = 600.0,
                 staleness_aware: bool = True, checkpoint_dir: Optional[str | Path] = None):
        self.cfg = cfg
        self.learner = learner
        self.rollout = rollout
        self.batch_size = learner.cfg.train_batch_trajectories
        cfg.validate(self.batch_size)
        if cfg.synchronous:
            raise ValueError("the concurrent scheduler is asynchronous; use scheduler=deterministic for synchronous")
        self.buffer = TrajectoryBuffer(cfg.buffer_capacity or 4 * self.batch_size)
        self.max_inflight = cfg.max_inflight_trajectories or 2 * self.batch_size
        self.rollout.group_size = learner.cfg.group_size
        self.rollout.wait_for_env = False  # real time: env calls are collected as they finish, none waited out
        self.on_step = on_step
        self.wait_timeout_s = wait_timeout_s
        self.history: list[dict] = []
        self.stats = RunStats()
        self.switch_state = "none"
        self.kept_groups: set[str] = set()
        self._last_bootstrap = False
        self._lock = threading.Lock()  # guards rollout manager state and switch_state
        self._ready = threading.Condition()  # guards the buffer; notified when trajectories arrive
        self._stop = threading.Event()
        self._error: Optional[str] = None
        self._rollout_busy_s = 0.0
        self._trainer_wait_s = 0.0
        self.staleness_aware = staleness_aware  # admission + stale aborts (False: the loop without them)
        self._training_batch = 0  # trajectories taken by the trainer and not yet published
        self.aborted_stale = 0  # live episodes aborted because their oldest token already exceeded the cap
        self.stale_wasted_tokens = 0
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.on_checkpoint: Optional[Callable[[Path], None]] = None  # called with each checkpoint written
        self.resumed_from: Optional[Path] = None

    # ------------------------------------------------------------------ rollout thread
    def _rollout_loop(self) -> None:
        try:
            while not self._stop.is_set():
                started = time.perf_counter()
                with self._lock:
                    finished: list[Trajectory] = []
                    # Li2SAO switch: nothing launches while the kept job drains, nor once it has ("drained")
                    # until the trainer has published the held version and moved on to "done"; the state
                    # is read under _lock, so this is an ordering, not a race for the lock
                    if self.switch_state not in ("draining", "drained"):
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
                                self.stats.trajectories_finished += 1
                                if self.switch_state == "draining" and traj.group_id not in self.kept_groups:
                                    self.buffer.counters.discarded += 1
                                    continue
                                self.buffer.add(traj)
                            self._ready.notify_all()
                if busy:
                    self._rollout_busy_s += time.perf_counter() - started
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
            if self.switch_state == "draining":
                return  # the Li2SAO switch decides about every live group itself
            stale = set()
            for episode in self.rollout.episodes.values():
                versions = [v for seg in episode.trajectory.segments if seg.kind == "model" for v in seg.versions]
                if versions and version - min(versions) > cap:
                    stale.add(episode.trajectory.group_id)
            if not stale:
                return
            wasted = sum(len(seg.token_ids) for ep in self.rollout.episodes.values()
                         if ep.trajectory.group_id in stale for seg in ep.trajectory.segments if seg.kind == "model")
            keep = set(self.rollout.live_group_ids()) - stale
            with self._ready:
                self.aborted_stale += self.rollout.discard_except(keep)
                self.stale_wasted_tokens += wasted
                # members of those groups already buffered would wait for ever for the aborted ones: drop them
                self.buffer.discard_except(set(self.buffer.group_ids_oldest_first()) - stale)

    # ------------------------------------------------------------------ trainer (calling thread)
    def _wait_for_batch(self) -> list[Trajectory]:
        deadline = time.monotonic() + self.wait_timeout_s
        started = time.perf_counter()
        with self._ready:
            while True:
                if self._error is not None:
                    raise RolloutThreadError(f"the rollout thread failed:\n{self._error}")
                version = self.learner.policy_version
                if self.switch_state == "drained":
                    self.switch_state = "done"
                    kept = take_last_bootstrap_batch(self.buffer, self.learner, self.batch_size,
                                                     self.cfg.staleness_cap)
                    if kept:
                        self._training_batch = len(kept)
                        self._last_bootstrap = True  # trained with the bootstrap estimator, then switch
                        self._trainer_wait_s += time.perf_counter() - started
                        return kept
                    self.learner.switch_to_single_rollout()
                    continue
                batch = self.buffer.take_batch(self.batch_size, version, self.cfg.staleness_cap)
                if batch is not None:
                    self._training_batch = len(batch)  # still untrained for the admission rule until published
                    self._trainer_wait_s += time.perf_counter() - started
                    return batch
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no batch of {self.batch_size} trajectories within {self.wait_timeout_s:.0f} s "
                        f"(ready {self.buffer.num_ready}, in flight {self.rollout.inflight_trajectories})")
                self._ready.wait(timeout=0.5)

    def _weights_for_publication(self) -> dict:
        return weights_for_engine(self.learner.actor, self.rollout.engine, self.learner.policy_version)

    def _publish(self, weights: Optional[dict]) -> None:
        if weights is not None:
            # in-driver engine: applied by the rollout thread at its next token boundary (or at once between
            # chunks); replicas: every replica pauses at a token boundary, loads, resumes (ReplicaPool.update_weights)
            self.rollout.engine.update_weights(weights, self.learner.policy_version)

    def _begin_switch(self) -> None:
        """Spec §4 in real time: keep the prefetched job, discard the rest, stop launching."""
        self.stats.switch_step = self.learner.step
        with self._lock, self._ready:
            self.kept_groups = choose_prefetched_job(self.buffer, self.rollout, self.batch_size,
                                                     self.learner.cfg.group_size)
            self.stats.discarded_at_switch = (self.buffer.discard_except(self.kept_groups)
                                              + self.rollout.discard_except(self.kept_groups))
            self.switch_state = "draining"

    def _finish_switch(self) -> None:
        """Wait for the kept job, then install n_s before the next generation request."""
        deadline = time.monotonic() + self.wait_timeout_s
        while True:
            if self._error is not None:
                raise RolloutThreadError(f"the rollout thread failed:\n{self._error}")
            with self._lock:
                if not any(ep.trajectory.group_id in self.kept_groups for ep in self.rollout.episodes.values()):
                    self.rollout.group_size = self.learner.cfg.single_group_size
                    self.switch_state = "drained"
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("the prefetched job did not finish in time during the Li2SAO switch")
            time.sleep(0.005)

    def run(self) -> list[dict]:
        thread = threading.Thread(target=self._rollout_loop, name="async_rl-rollout", daemon=True)
        wall_start = time.perf_counter()
        thread.start()
        try:
            while self.learner.step < self.cfg.total_steps:
                batch = self._wait_for_batch()
                metrics = self.learner.train_step(batch)
                if self._last_bootstrap:
                    self.learner.switch_to_single_rollout()
                    self._last_bootstrap = False
                weights = self._weights_for_publication() if metrics["actor/updated"] > 0 else None
                if metrics.get("li2sao/gate_opened"):
                    self._begin_switch()
                    self._finish_switch()  # publication waits for the outstanding job (spec §4)
                self._publish(weights)
                self._training_batch = 0
                self._abort_stale_live()
                elapsed = time.perf_counter() - wall_start
                metrics.update({
                    "async/dropped_stale": float(self.buffer.counters.dropped_stale),
                    "async/aborted": float(self.buffer.counters.aborted),
                    "async/discarded": float(self.buffer.counters.discarded),
                    "async/aborted_stale": float(self.aborted_stale),
                    "async/wasted_tokens": float(self.stale_wasted_tokens),
                    "async/group_size": float(self.rollout.group_size),
                    "perf/trainer_idle_frac": self._trainer_wait_s / max(elapsed, 1e-9),
                    "perf/rollout_idle_frac": 1.0 - self._rollout_busy_s / max(elapsed, 1e-9),
                    "perf/trajectories_per_s": self.stats.trajectories_finished / max(elapsed, 1e-9),
                    "perf/tokens_per_s": self.rollout.generated_tokens / max(elapsed, 1e-9),
                    "perf/wall_s": elapsed,
                })
                metrics.update(self.rollout.env_metrics())
                engine_metrics = getattr(self.rollout.engine, "metrics", None)
                if callable(engine_metrics):  # rollout replicas: liveness, aborted by failures, update latency
                    replica_metrics = engine_metrics()
                    # tokens lost on the replicas (aborts, failures) add to the stale aborts' tokens
                    replica_metrics["async/wasted_tokens"] += self.stale_wasted_tokens
                    metrics.update(replica_metrics)
                self.history.append(metrics)
                if self.on_step is not None:
                    self.on_step(metrics)
                if weights is not None and self.checkpoint_dir and self.cfg.checkpoint_every and \
                        self.learner.step % self.cfg.checkpoint_every == 0:
                    self.save_checkpoint()
        finally:
            self._stop.set()
            thread.join(timeout=60)
            if not thread.is_alive():  # abort what is still live, close its envs, stop the env workers
                self.rollout.close()
        return self.history

    # ------------------------------------------------------------------ checkpoint and resume
    def state_dict(self) -> dict:
        """The run at a cut: called by the trainer right after a publication, holding ``_lock`` (the rollout
        thread is between two iterations). Env calls still in flight are waited out first and the
        trajectories they finish go to the buffer, so the cut holds no half-done env step. Same layout as
        the deterministic driver's (``format`` 1, plus ``scheduler``)."""
        with self._ready:
            for traj in self.rollout.settle_env_calls():
                self.stats.trajectories_finished += 1
                if self.switch_state == "draining" and traj.group_id not in self.kept_groups:
                    self.buffer.counters.discarded += 1
                    continue
                self.buffer.add(traj)
            # the weights of this version were handed to the engine just before the cut (in-driver engine:
            # applied at its next token boundary), so that is the version the resumed engine runs
            return {**run_state(self, self.learner.policy_version), "scheduler": "concurrent",
                    "aborted_stale": self.aborted_stale, "stale_wasted_tokens": self.stale_wasted_tokens}

    def load_state_dict(self, state: dict) -> None:
        load_run_state(self, state)
        self.aborted_stale = int(state.get("aborted_stale", 0))
        self.stale_wasted_tokens = int(state.get("stale_wasted_tokens", 0))

    def save_checkpoint(self) -> Path:
        """As :meth:`DeterministicDriver.save_checkpoint` (atomic, checksummed, sharded model state for worker
        groups, ``keep_last``), taken with the rollout thread held at the cut of :meth:`state_dict`."""
        shards = self.learner.save_model_shards if self.learner.model_state_sharded else None
        with self._lock:
            path = write_checkpoint(self.state_dict(), self.checkpoint_dir, self.learner.step, write_shards=shards)
        prune_checkpoints(self.checkpoint_dir, self.learner.step, self.cfg.keep_last)
        if self.on_checkpoint is not None:
            self.on_checkpoint(path)
        return path

    def resume(self, path: Optional[str | Path] = None) -> bool:
        """Continue from ``path`` or the newest intact checkpoint (call before :meth:`run`); False when there
        is none. Falls back past damaged checkpoints like the deterministic driver; a resumed concurrent run
        continues the run (no trained step lost or repeated) but is not bit for bit (real time)."""
        self.resumed_from = resume_checkpoint(self.load_state_dict, self.checkpoint_dir, path)
        return self.resumed_from is not None
