"""The run both schedulers share (spec §1, §4): intake into the staleness-capped buffer, batches, the training
step, the Li2SAO switch, step metrics and checkpoints. A scheduler (``driver.py`` on a simulated clock,
``concurrent.py`` in real time) only decides *when* each of these happens.

Li2SAO switch (spec §4) as one state machine, :class:`SwitchPhase`, advanced only here:

  NONE --gate opens (begin_switch)--> DRAINING --kept job received (install_single_rollout)--> DRAINED
       --kept job taken as a batch (take_batch)--> LAST_BOOTSTRAP --trained (train)--> DONE

While DRAINING or DRAINED nothing launches (:attr:`RunCore.launch_held`) and, while DRAINING, nothing is
published; the learner's estimator changes (``Learner.switch_to_single_rollout``) right after the last bootstrap
batch has trained, and the rollout's group size when the kept job has been received.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager, Optional

import numpy as np
import torch

from async_rl.driver.buffer import TrajectoryBuffer
from async_rl.driver.checkpoint import prune_checkpoints, resume_checkpoint, write_checkpoint
from async_rl.driver.learner import Learner, StepResult
from async_rl.driver.rollout_manager import RolloutManager
from async_rl.driver.settings import DriverConfig  # noqa: F401  (defined without torch: the CLI checks it first)
from async_rl.driver.trajectory import Trajectory
from async_rl.rollout.publication import choose_publication_form, weights_to_publish


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


class SwitchPhase(str, enum.Enum):
    """Where the run is in Li2SAO's one switch (module docstring); the value is what checkpoints store."""

    NONE = "none"  # no switch yet (every algorithm but Li2SAO stays here)
    DRAINING = "draining"  # gate opened: the kept job finishes at n_b; no launch, no publication
    DRAINED = "drained"  # kept job received, n_s installed; launches held until it is taken as a batch
    LAST_BOOTSTRAP = "last_bootstrap"  # the kept job is training with the bootstrap estimator
    DONE = "done"  # single rollout for the rest of the run


class RunStopped(Exception):
    """The run stopped early at a cut because :meth:`RunCore.request_stop` was called (SIGINT/SIGTERM in the
    CLI). ``checkpoint``: the checkpoint holding step ``step`` (None when no step had trained, or the driver has
    no checkpoint directory)."""

    def __init__(self, reason: str, step: int, checkpoint: Optional[Path], save_error: Optional[str] = None):
        super().__init__(f"stopped at step {step} ({reason})")
        self.reason = reason
        self.step = step
        self.checkpoint = checkpoint
        self.save_error = save_error  # why the final checkpoint could not be written (checkpoint: the newest before)


@dataclass
class RunStats:
    """Counters a checkpoint carries (the deterministic scheduler's ticks among them)."""

    ticks: int = 0
    trainer_busy_ticks: int = 0
    rollout_busy_ticks: int = 0
    trajectories_finished: int = 0
    switch_step: Optional[int] = None
    discarded_at_switch: int = 0


@dataclass
class RealTime:
    """Wall-clock seconds since this process started the run (not checkpointed: a resumed run starts over)."""

    start: float = field(default_factory=time.perf_counter)
    training_s: float = 0.0  # inside Learner.train_step
    rollout_busy_s: float = 0.0  # launching and generating
    checkpoint_s: float = 0.0  # writing checkpoints (and what on_checkpoint does: the policy's export)

    def elapsed(self) -> float:
        return max(time.perf_counter() - self.start, 1e-9)


class RunCore(abc.ABC):
    """State and steps of one run; subclasses schedule them and say what a checkpoint adds (``state_dict``).
    ``cfg.validate`` runs here."""

    def __init__(self, cfg: DriverConfig, learner: Learner, rollout: RolloutManager, *,
                 on_step: Optional[Callable[[dict], None]] = None, checkpoint_dir: Optional[str | Path] = None):
        self.cfg = cfg
        self.learner = learner
        self.rollout = rollout
        self.batch_size = learner.cfg.train_batch_trajectories
        cfg.validate(self.batch_size, learner.cfg.group_size)
        self.buffer = TrajectoryBuffer(cfg.buffer_capacity or 4 * self.batch_size)
        self.max_inflight = cfg.max_inflight_trajectories or 2 * self.batch_size
        self.rollout.group_size = learner.cfg.group_size
        self.publication_form = choose_publication_form(learner.actor, rollout.engine)  # how publications travel
        self.on_step = on_step
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        # called with the checkpoint's path after each save (train.py exports the policy as a model there)
        self.on_checkpoint: Optional[Callable[[Path], None]] = None
        self.resumed_from: Optional[Path] = None  # the checkpoint resume() loaded
        self.last_checkpoint: Optional[tuple[int, Path]] = None  # (step, path) of the newest one saved or loaded
        # set by request_stop (a signal handler): the scheduler stops at its next cut (RunStopped)
        self.stop_reason: Optional[str] = None
        self.switch = SwitchPhase.NONE
        self.kept_groups: set[str] = set()
        self.stats = RunStats()
        self.time = RealTime()
        self.history: list[dict] = []

    # ------------------------------------------------------------------ rollout -> buffer -> batch
    @property
    def launch_held(self) -> bool:
        """No prompt launches from the gate's opening until the kept job is taken as a batch (spec §4, step 3),
        so the first single-rollout request runs the post-switch policy."""
        return self.switch in (SwitchPhase.DRAINING, SwitchPhase.DRAINED)

    def intake(self, trajectory: Trajectory) -> None:
        """A finished trajectory into the buffer, unless the switch is draining and it is not the kept job's."""
        self.stats.trajectories_finished += 1
        if self.switch is SwitchPhase.DRAINING and trajectory.group_id not in self.kept_groups:
            self.buffer.counters.discarded += 1
            return
        self.buffer.add(trajectory)

    def take_batch(self) -> Optional[list[Trajectory]]:
        """The next batch within the staleness cap, or None. Right after the switch drained, the kept job --
        whatever of it survived aborts and the cap -- is the batch (the last bootstrap one); when nothing
        survived, the learner switches now and this returns None."""
        version, cap = self.learner.policy_version, self.cfg.staleness_cap
        if self.switch is SwitchPhase.DRAINED:
            self.buffer.drop_stale(version, cap)
            kept = self.buffer.take_batch(min(self.buffer.num_ready, self.batch_size), version, cap) \
                if self.buffer.num_ready else None
            if kept:
                self.switch = SwitchPhase.LAST_BOOTSTRAP
                return kept
            self.learner.switch_to_single_rollout()
            self.switch = SwitchPhase.DONE
            return None
        return self.buffer.take_batch(self.batch_size, version, cap)

    # ------------------------------------------------------------------ update
    def train(self, batch: list[Trajectory]) -> tuple[StepResult, Optional[object]]:
        """One learner step; returns it and the weights to publish (None when the actor did not update)."""
        started = time.perf_counter()
        result = self.learner.train_step(batch)
        self.time.training_s += time.perf_counter() - started
        if self.switch is SwitchPhase.LAST_BOOTSTRAP:  # trained with the bootstrap estimator: now switch
            self.learner.switch_to_single_rollout()
            self.switch = SwitchPhase.DONE
        weights = self.weights_for(self.learner.policy_version) if result.actor_updated else None
        return result, weights

    def weights_for(self, version: int):
        """The actor's weights as ``version``, in the form :attr:`publication_form` sends them."""
        return weights_to_publish(self.publication_form, self.learner.actor, version)

    # ------------------------------------------------------------------ Li2SAO switch (spec §4)
    def begin_switch(self) -> None:
        """Steps 1-2: keep the prefetched job, discard every other buffered or live trajectory."""
        self.stats.switch_step = self.learner.step
        self.kept_groups = choose_prefetched_job(self.buffer, self.rollout, self.batch_size,
                                                 self.learner.cfg.group_size)
        self.stats.discarded_at_switch = (self.buffer.discard_except(self.kept_groups)
                                          + self.rollout.discard_except(self.kept_groups))
        self.switch = SwitchPhase.DRAINING

    def kept_job_generating(self) -> bool:
        return any(ep.trajectory.group_id in self.kept_groups for ep in self.rollout.episodes.values())

    def install_single_rollout(self) -> None:
        """Step 4: n_s (and so B / n_s prompts) before the next generation request."""
        self.rollout.group_size = self.learner.cfg.single_group_size
        self.switch = SwitchPhase.DRAINED

    # ------------------------------------------------------------------ metrics
    def step_metrics(self) -> dict[str, float]:
        """The keys both schedulers report (docs/metrics.md); ``perf/*`` are real time in both."""
        counters, elapsed = self.buffer.counters, self.time.elapsed()
        return {
            "async/dropped_stale": float(counters.dropped_stale),
            "async/aborted": float(counters.aborted),
            "async/discarded": float(counters.discarded),
            "async/group_size": float(self.rollout.group_size),
            "perf/trainer_idle_frac": max(0.0, 1.0 - self.time.training_s / elapsed),
            "perf/rollout_idle_frac": max(0.0, 1.0 - self.time.rollout_busy_s / elapsed),
            "perf/trajectories_per_s": self.stats.trajectories_finished / elapsed,
            "perf/tokens_per_s": self.rollout.generated_tokens / elapsed,
            "perf/wall_s": elapsed,
            **self.rollout.env_metrics(),  # env calls: failed, hung, leaked threads (rollout_manager.py)
        }

    def record(self, metrics: dict) -> None:
        self.history.append(metrics)
        if self.on_step is not None:
            self.on_step(metrics)

    # ------------------------------------------------------------------ checkpoint and resume
    def checkpoint_due(self) -> bool:
        return bool(self.checkpoint_dir and self.cfg.checkpoint_every
                    and self.learner.step % self.cfg.checkpoint_every == 0)

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """The checkpoint: :meth:`_run_state` plus the scheduler's own fields."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Inverse of :meth:`state_dict` (:meth:`_load_run_state` plus the scheduler's own fields)."""

    def _run_state(self, engine_version: int) -> dict:
        """The checkpoint fields both schedulers share (format 1): switch, stats, learner, buffer, rollout, the
        version the engine runs, history and random states. Each scheduler adds its own (clock, counters)."""
        if self.switch is SwitchPhase.LAST_BOOTSTRAP:
            raise RuntimeError("checkpoints are taken after a publication, never while the kept job trains")
        return {
            "format": 1,
            "switch_state": self.switch.value,
            "kept_groups": sorted(self.kept_groups),
            "stats": dict(vars(self.stats)),
            "learner": self.learner.state_dict(),
            "buffer": self.buffer.state_dict(),
            "rollout": self.rollout.state_dict(),
            "engine_version": int(engine_version),
            "history": self.history,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        }

    def _load_run_state(self, state: dict) -> None:
        """Restore :meth:`_run_state`'s fields; the engine is given the learner's restored weights as the
        checkpoint's engine version (the rollout runs the published weights) before the rollout's own state."""
        if state.get("format") != 1:
            raise ValueError(f"unsupported checkpoint format {state.get('format')!r}")
        self.switch = SwitchPhase(state["switch_state"])
        self.kept_groups = set(state["kept_groups"])
        for key, value in state["stats"].items():
            if key in RunStats.__dataclass_fields__:  # older checkpoints also held a wall-clock start
                setattr(self.stats, key, value)
        shards = state.get("shards") or {}
        self.learner.load_state_dict(state["learner"], shards_dir=shards.get("path"))
        self.buffer.load_state_dict(state["buffer"])
        engine, version = self.rollout.engine, state["engine_version"]
        engine.update_weights(self.weights_for(version), version)
        self.rollout.load_state_dict(state["rollout"])
        self.history = list(state["history"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])

    def _at_cut(self) -> ContextManager:
        """Held while the checkpoint is taken (the concurrent scheduler holds its rollout thread here)."""
        return contextlib.nullcontext()

    def save_checkpoint(self) -> Path:
        """Write ``step_<N>.pt`` atomically with its SHA-256 checksum, point ``latest`` at it, then keep only
        the newest ``keep_last`` checkpoints (:mod:`async_rl.driver.checkpoint`). Worker-group trainers
        (``trainer.workers=ray``) write their model and optimizer shards into ``step_<N>.pt.shards/``, every
        rank its own, committed by the same rename."""
        started = time.perf_counter()
        shards = self.learner.save_model_shards if self.learner.model_state_sharded else None
        with self._at_cut():
            path = write_checkpoint(self.state_dict(), self.checkpoint_dir, self.learner.step, write_shards=shards)
        prune_checkpoints(self.checkpoint_dir, self.learner.step, self.cfg.keep_last)
        self.last_checkpoint = (self.learner.step, path)
        if self.on_checkpoint is not None:
            self.on_checkpoint(path)
        self.time.checkpoint_s += time.perf_counter() - started
        return path

    def resume(self, path: Optional[str | Path] = None) -> bool:
        """Continue from ``path``, or from the newest intact checkpoint of ``checkpoint_dir`` (call before
        ``run``); False when there is none.

        Without ``path``, a truncated or corrupt newest checkpoint (checksum or load failure) is skipped for
        the previous one, with a printed message. Raises :class:`CheckpointError` when no checkpoint is
        usable or the one read does not fit this run's config; a failed resume changes no file.
        """
        self.resumed_from = resume_checkpoint(self.load_state_dict, self.checkpoint_dir, path)
        if self.resumed_from is not None:
            self.last_checkpoint = (self.learner.step, self.resumed_from)
        return self.resumed_from is not None

    # ------------------------------------------------------------------ stopping early
    def request_stop(self, reason: str) -> None:
        """Ask the scheduler to stop at its next cut (where a periodic checkpoint could be taken): safe to call
        from a signal handler; the run then ends with :class:`RunStopped` after :meth:`stop_at_cut`."""
        self.stop_reason = reason

    def stop_at_cut(self) -> None:
        """Called by a scheduler at a cut once a stop was requested: write a final checkpoint when a step has
        trained since the newest one (nothing trained: nothing worth keeping), then raise :class:`RunStopped`.
        The checkpoint is the one a periodic save at this step would write, so a resumed run continues as the
        uninterrupted run would."""
        path, save_error = None, None
        if self.learner.step > 0 and self.checkpoint_dir is not None:
            if self.last_checkpoint is not None and self.last_checkpoint[0] == self.learner.step:
                path = self.last_checkpoint[1]
            else:
                try:
                    path = self.save_checkpoint()
                except Exception as err:  # e.g. a worker the same Ctrl-C ended: say so, keep the newest one
                    save_error = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
                    path = self.last_checkpoint[1] if self.last_checkpoint is not None else None
        raise RunStopped(self.stop_reason or "stop requested", self.learner.step, path, save_error)
