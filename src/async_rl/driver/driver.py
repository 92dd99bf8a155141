"""The asynchronous driver loop (spec §1, §4): rollout streams trajectories into a staleness-capped buffer,
the trainer takes a batch whenever one is ready, weights are published in flight, and Li2SAO switches
from group bootstrap to single rollout with the exact protocol of spec §4.

Deterministic scheduler (this module): one process, a simulated clock. Each tick generates one chunk of
``chunk_tokens`` tokens for every live request; a trainer update that starts at tick ``t`` publishes its
weights at tick ``t + update_ticks`` (the rollout keeps generating under the old weights meanwhile, as in
the real system). Same seed, same config: the same run, bit for bit.

Switch protocol (Li2SAO, spec §4), when the gate opens after training step k:
  1. the prefetched job -- the oldest prompt groups (ready, buffered or still generating) worth one
     batch -- is kept and finished at group size n_b;
  2. everything else (leftover bootstrap groups, unfinished generations, the pending buffer) is discarded;
  3. no new prompt is launched and no weights are published until the kept job has been received;
  4. the new group size n_s and prompt count B/n_s are installed before the next generation request;
  5. the kept job trains as the last bootstrap batch; every later batch is single-rollout.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from async_rl.driver.buffer import TrajectoryBuffer
from async_rl.driver.checkpoint import prune_checkpoints, resume_checkpoint, write_checkpoint
from async_rl.driver.learner import Learner
from async_rl.driver.rollout_manager import RolloutManager
from async_rl.driver.trajectory import Trajectory


@dataclass
class DriverConfig:
    total_steps: int = 100  # optimizer batches to train
    staleness_cap: int = 4  # k, spec §1: drop trajectories holding a token with policy lag > k
    max_inflight_trajectories: Optional[int] = None  # rollout capacity (live episodes); None = 2 B
    buffer_capacity: Optional[int] = None  # finished trajectories held; None = 4 B
    chunk_tokens: int = 8  # tokens generated per scheduler tick (weights can change between chunks)
    update_ticks: int = 4  # deterministic scheduler: simulated duration of one trainer update, in ticks
    checkpoint_every: int = 0  # save a checkpoint every this many steps (0 = never)
    keep_last: int = 3  # checkpoints kept on disk (older ones are deleted); >= 2 leaves one to fall back to
    synchronous: bool = False  # colocated synchronous baseline: generate one batch, train, publish, repeat

    # allowed range of every numeric field (types come from the annotations above)
    RANGES = {
        "total_steps": ">= 1",
        "staleness_cap": ">= 0",  # 0 = strictly on-policy
        "max_inflight_trajectories": ">= 1",
        "buffer_capacity": ">= 1",
        "chunk_tokens": ">= 1",
        "update_ticks": ">= 0",
        "checkpoint_every": ">= 0",
        "keep_last": ">= 1",
    }

    @classmethod
    def from_dict(cls, data: dict) -> "DriverConfig":
        """From a plain dict (the resolved ``trainer.driver`` node); unknown keys fail with the valid ones."""
        from async_rl.validation import dataclass_from_mapping

        return dataclass_from_mapping(cls, data, "trainer.driver")

    def validate(self, batch_size: int) -> None:
        """Types and ranges of every field (one line naming ``trainer.driver.<key>``, the value and what is
        allowed), then the capacities against one batch of ``batch_size`` trajectories."""
        from async_rl.validation import ConfigError, check_dataclass

        check_dataclass(self, "trainer.driver", self.RANGES)
        if self.buffer_capacity is not None and self.buffer_capacity < batch_size:
            raise ConfigError(f"trainer.driver.buffer_capacity={self.buffer_capacity}: must hold at least one "
                              f"batch ({batch_size} trajectories)")


def weights_for_engine(actor, engine, version: int):
    """The new weights in the form ``engine.update_weights`` takes them, moved as little as possible.

    A pool that gets the weights itself (``engine.takes_version_only``: replicas inside the train ranks,
    ``rollout.mode=hybrid``, copy them in memory; verl's checkpoint manager pulls them from the actor ranks) is sent
    only the version. Other replicas (``ReplicaPool``) take the handle of actor rank 0's ``ray.put`` (the weights go
    from the object store to each replica, never through the driver). The in-driver engine takes the state dict.
    """
    if getattr(engine, "takes_version_only", False):
        from async_rl.rollout.checkpoint_engine import in_process_handle

        return in_process_handle(version)
    if getattr(engine, "accepts_published_weights", False) and hasattr(actor, "publish_weights"):
        return actor.publish_weights(version)
    return actor.export_weights()


def run_state(driver, engine_version: int) -> dict:
    """The checkpoint fields both schedulers share (format 1): switch state, stats, learner, buffer, rollout,
    the version the engine runs, history and random states. Each scheduler adds its own (clock, counters)."""
    return {
        "format": 1,
        "switch_state": driver.switch_state,
        "kept_groups": sorted(driver.kept_groups),
        "stats": {k: v for k, v in vars(driver.stats).items() if k != "wall_start"},
        "learner": driver.learner.state_dict(),
        "buffer": driver.buffer.state_dict(),
        "rollout": driver.rollout.state_dict(),
        "engine_version": int(engine_version),
        "history": driver.history,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
    }


def load_run_state(driver, state: dict) -> None:
    """Restore :func:`run_state`'s fields; the engine is given the learner's restored weights as the checkpoint's
    engine version (the rollout runs the published weights) before the rollout's own state is loaded."""
    if state.get("format") != 1:
        raise ValueError(f"unsupported checkpoint format {state.get('format')!r}")
    driver.switch_state = state["switch_state"]
    driver.kept_groups = set(state["kept_groups"])
    for key, value in state["stats"].items():
        setattr(driver.stats, key, value)
    shards = state.get("shards") or {}
    driver.learner.load_state_dict(state["learner"], shards_dir=shards.get("path"))
    driver.buffer.load_state_dict(state["buffer"])
    engine, version = driver.rollout.engine, state["engine_version"]
    engine.update_weights(weights_for_engine(driver.learner.actor, engine, version), version)
    driver.rollout.load_state_dict(state["rollout"])
    driver.history = list(state["history"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])


def choose_prefetched_job(buffer: TrajectoryBuffer, rollout: RolloutManager, batch_size: int,
                          group_size: int) -> set[str]:
    """Li2SAO switch, step 1: the prefetched job = the oldest groups, ready first, then buffered partial
    groups, then groups still generating, worth at most one batch."""
    candidates = buffer.group_ids_oldest_first() + rollout.live_group_ids()
    keep: list[str] = []
    for gid in dict.fromkeys(candidates):
        if (len(keep) + 1) * group_size > batch_size:
            break
        keep.append(gid)
    return set(keep)


def take_last_bootstrap_batch(buffer: TrajectoryBuffer, learner: Learner, batch_size: int,
                              staleness_cap: int) -> list[Trajectory]:
    """Li2SAO switch, last step: the kept job (whatever survived aborts and the staleness cap) is the last
    bootstrap batch. The caller trains it, *then* calls ``learner.switch_to_single_rollout()``, so this batch
    still uses the bootstrap estimator and loss (spec §4)."""
    version = learner.policy_version
    buffer.drop_stale(version, staleness_cap)
    batch = buffer.take_batch(min(buffer.num_ready, batch_size), version, staleness_cap) \
        if buffer.num_ready else []
    return batch or []


@dataclass
class _Publish:
    weights: Optional[dict]  # None: the step did not update the actor (LiSAO warm-up)
    version: int
    ready_at: int


@dataclass
class RunStats:
    ticks: int = 0
    trainer_busy_ticks: int = 0
    rollout_busy_ticks: int = 0
    trajectories_finished: int = 0
    switch_step: Optional[int] = None
    discarded_at_switch: int = 0
    wall_start: float = field(default_factory=time.perf_counter)


class DeterministicDriver:
    """Runs the loop on a simulated clock in one process."""

    def __init__(self, cfg: DriverConfig, learner: Learner, rollout: RolloutManager, *,
                 on_step: Optional[Callable[[dict], None]] = None, checkpoint_dir: Optional[str | Path] = None):
        self.cfg = cfg
        self.learner = learner
        self.rollout = rollout
        algo = learner.cfg
        self.batch_size = algo.train_batch_trajectories
        cfg.validate(self.batch_size)
        self.buffer = TrajectoryBuffer(cfg.buffer_capacity or 4 * self.batch_size)
        self.max_inflight = cfg.max_inflight_trajectories or 2 * self.batch_size
        self.rollout.group_size = algo.group_size
        self.on_step = on_step
        self.checkpoint_dir = checkpoint_dir
        # called with the checkpoint's path after each save (train.py exports the policy as a model there)
        self.on_checkpoint: Optional[Callable[[Path], None]] = None
        self._target = cfg.total_steps
        self.clock = 0
        self.publish: Optional[_Publish] = None
        self.switch_state = "none"  # none -> draining -> drained -> done
        self.kept_groups: set[str] = set()
        self._last_bootstrap = False
        self.stats = RunStats()
        self.history: list[dict] = []
        self.resumed_from: Optional[Path] = None  # the checkpoint resume() loaded

    # ------------------------------------------------------------------ main loop
    def run(self, until_step: Optional[int] = None) -> list[dict]:
        """Run until the learner has consumed ``until_step`` batches (default: ``total_steps``)."""
        target = until_step if until_step is not None else self.cfg.total_steps
        self._target = target
        # the last update is published before returning, so the run ends at a checkpointable point
        while self.learner.step < target or self.publish is not None:
            progressed, published = self._tick()
            if not progressed:
                raise RuntimeError(self._stall_report())
            if published and self.checkpoint_dir and self.cfg.checkpoint_every and \
                    self.learner.step % self.cfg.checkpoint_every == 0:
                self.save_checkpoint()
        self.rollout.release_env_threads()  # idle env workers exit; a later run() starts new ones
        return self.history

    def _tick(self) -> tuple[bool, bool]:
        """One tick: train if idle, generate one chunk, advance the clock, publish if due.

        A tick ends right after a publication, when the rollout engine has dropped its KV cache: that is
        the point where checkpoints are taken, so a resumed run re-does exactly what the original did.
        """
        progressed = published = False
        # trainer side: take a batch when idle --------------------------------------------------------
        if self.publish is None and self.learner.step < self._target:
            batch = self._next_batch()
            if batch is not None:
                self._train(batch)
                progressed = True
        if self.publish is not None:
            self.stats.trainer_busy_ticks += 1
            progressed = True  # the update is running; simulated time advances toward its publication
        # rollout side -------------------------------------------------------------------------------
        sync_blocked = self.cfg.synchronous and (self.publish is not None or self.buffer.num_ready >= self.batch_size)
        # Li2SAO switch: no launch from the moment the gate opens until the version held during the drain is
        # published (the trainer leaves "drained" only once that publication is done, in _next_batch), so the
        # first single-rollout request always runs the post-switch policy
        launch_held = self.switch_state in ("draining", "drained")
        if self.cfg.synchronous and not sync_blocked and not launch_held and not self.rollout.busy and \
                self.rollout.inflight_trajectories == 0 and len(self.buffer) == 0:
            # one batch worth of prompts, all under the current weights (no overlap with training)
            while self.rollout.inflight_trajectories + self.rollout.group_size <= self.batch_size:
                for traj in self.rollout.launch_prompt():
                    self._finished(traj)
            progressed = True
        if not self.cfg.synchronous and not launch_held:
            while (self.rollout.inflight_trajectories + self.rollout.group_size <= self.max_inflight
                   and self.buffer.has_room(self.rollout.inflight_trajectories + self.rollout.group_size)):
                for traj in self.rollout.launch_prompt():
                    self._finished(traj)
                progressed = True
        if self.rollout.busy and not sync_blocked:
            self.stats.rollout_busy_ticks += 1
            for traj in self.rollout.advance(self.cfg.chunk_tokens):
                self._finished(traj)
            progressed = True
        if self.switch_state == "draining" and not any(
                ep.trajectory.group_id in self.kept_groups for ep in self.rollout.episodes.values()):
            self._install_single_rollout()
            progressed = True
        self.clock += 1
        self.stats.ticks += 1
        # publication: weights reach the rollout in flight (held while the Li2SAO switch drains) -------
        if self.publish is not None and self.clock >= self.publish.ready_at and self.switch_state != "draining":
            if self.publish.weights is not None:
                self.rollout.engine.update_weights(self.publish.weights, self.publish.version)
                published = True
            self.publish = None
        return progressed, published

    # ------------------------------------------------------------------ checkpoint and resume
    def state_dict(self) -> dict:
        """Everything needed to continue bit for bit (taken at a tick boundary right after a publication)."""
        if self.publish is not None:
            raise RuntimeError("checkpoints are taken between an update's publication and the next batch")
        return {**run_state(self, self.rollout.engine.policy_version), "clock": self.clock}

    def load_state_dict(self, state: dict) -> None:
        load_run_state(self, state)
        self.clock = state["clock"]
        self.publish = None

    def save_checkpoint(self) -> Path:
        """Write ``step_<N>.pt`` atomically with its SHA-256 checksum, point ``latest`` at it, then keep only
        the newest ``keep_last`` checkpoints (:mod:`async_rl.driver.checkpoint`). Worker-group trainers
        (``trainer.workers=ray``) write their model and optimizer shards into ``step_<N>.pt.shards/``, every
        rank its own, committed by the same rename."""
        shards = self.learner.save_model_shards if self.learner.model_state_sharded else None
        path = write_checkpoint(self.state_dict(), self.checkpoint_dir, self.learner.step, write_shards=shards)
        prune_checkpoints(self.checkpoint_dir, self.learner.step, self.cfg.keep_last)
        if self.on_checkpoint is not None:
            self.on_checkpoint(path)
        return path

    def resume(self, path: Optional[str | Path] = None) -> bool:
        """Continue from ``path``, or from the newest intact checkpoint of ``checkpoint_dir``; False when
        there is none.

        Without ``path``, a truncated or corrupt newest checkpoint (checksum or load failure) is skipped for
        the previous one, with a printed message. Raises :class:`CheckpointError` when no checkpoint is
        usable or the one read does not fit this run's config; a failed resume changes no file.
        """
        self.resumed_from = resume_checkpoint(self.load_state_dict, self.checkpoint_dir, path)
        return self.resumed_from is not None

    def _finished(self, traj: Trajectory) -> None:
        self.stats.trajectories_finished += 1
        self.buffer.add(traj)

    def _next_batch(self) -> Optional[list[Trajectory]]:
        if self.switch_state == "drained":
            self.switch_state = "done"
            batch = take_last_bootstrap_batch(self.buffer, self.learner, self.batch_size, self.cfg.staleness_cap)
            if not batch:  # nothing of the kept job survived: switch now
                self.learner.switch_to_single_rollout()
                return None
            self._last_bootstrap = True
            return batch
        return self.buffer.take_batch(self.batch_size, self.learner.policy_version, self.cfg.staleness_cap)

    def _train(self, batch: list[Trajectory]) -> None:
        metrics = self.learner.train_step(batch)
        if self._last_bootstrap:  # the kept job trained with the bootstrap estimator; now switch (spec §4)
            self.learner.switch_to_single_rollout()
            self._last_bootstrap = False
        updated = metrics["actor/updated"] > 0
        weights = weights_for_engine(self.learner.actor, self.rollout.engine, self.learner.policy_version) \
            if updated else None
        self.publish = _Publish(weights, self.learner.policy_version, self.clock + self.cfg.update_ticks)
        if metrics.get("li2sao/gate_opened"):
            self._begin_switch()
        metrics.update(self._async_metrics())
        self.history.append(metrics)
        if self.on_step is not None:
            self.on_step(metrics)

    # ------------------------------------------------------------------ Li2SAO switch (spec §4)
    def _begin_switch(self) -> None:
        self.stats.switch_step = self.learner.step
        self.kept_groups = choose_prefetched_job(self.buffer, self.rollout, self.batch_size,
                                                 self.learner.cfg.group_size)
        discarded = self.buffer.discard_except(self.kept_groups) + self.rollout.discard_except(self.kept_groups)
        self.stats.discarded_at_switch = discarded
        self.switch_state = "draining"

    def _install_single_rollout(self) -> None:
        self.rollout.group_size = self.learner.cfg.single_group_size
        self.switch_state = "drained"

    # ------------------------------------------------------------------ metrics
    def _async_metrics(self) -> dict[str, float]:
        c = self.buffer.counters
        s = self.stats
        elapsed = time.perf_counter() - s.wall_start
        return {
            "async/dropped_stale": float(c.dropped_stale),
            "async/aborted": float(c.aborted),
            "async/discarded": float(c.discarded),
            "async/buffer_ready": float(self.buffer.num_ready),
            "async/inflight_trajectories": float(self.rollout.inflight_trajectories),
            "async/group_size": float(self.rollout.group_size),
            "async/clock_ticks": float(self.clock),
            "perf/trainer_idle_frac": 1.0 - s.trainer_busy_ticks / max(s.ticks, 1),
            "perf/rollout_idle_frac": 1.0 - s.rollout_busy_ticks / max(s.ticks, 1),
            "perf/trajectories_per_s": s.trajectories_finished / max(elapsed, 1e-9),
            "perf/tokens_per_s": self.rollout.generated_tokens / max(elapsed, 1e-9),
            "perf/wall_s": elapsed,
            **self.rollout.env_metrics(),  # env calls: failed, hung, leaked threads (rollout_manager.py)
        }

    def _stall_report(self) -> str:
        return (
            "driver stalled: nothing to generate, no batch to train, nothing to publish. "
            f"buffer ready={self.buffer.num_ready} partial groups={self.buffer.num_partial_groups} "
            f"capacity={self.buffer.capacity}, inflight={self.rollout.inflight_trajectories}, "
            f"batch size={self.batch_size}, group size={self.rollout.group_size}, switch={self.switch_state}. "
            "Raise buffer_capacity / max_inflight_trajectories so one batch fits."
        )
