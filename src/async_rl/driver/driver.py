"""The asynchronous driver loop (spec §1, §4), deterministic scheduler: :class:`DeterministicDriver`.

Rollout streams trajectories into a staleness-capped buffer, the trainer takes a batch whenever one is
ready, weights are published in flight, and Li2SAO switches from group bootstrap to single rollout with
the exact protocol of spec §4. One process, a simulated clock: each tick generates one chunk of
``chunk_tokens`` tokens for every live request; an update that starts at tick ``t`` publishes its weights
at tick ``t + update_ticks``. Same seed, same config: the same run, bit for bit.

Details: docs/driver.md (The loop (deterministic scheduler); Li2SAO switch protocol (spec §4)).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from async_rl.driver.core import (  # noqa: F401  (DriverConfig: a public name of this module)
    DriverConfig,
    RunCore,
    SwitchPhase,
)
from async_rl.driver.learner import Learner
from async_rl.driver.rollout_manager import RolloutManager


@dataclass
class _Publish:
    weights: Optional[object]  # None: the step did not update the actor (LiSAO warm-up)
    version: int
    ready_at: int


class DeterministicDriver(RunCore):
    """Runs the loop on a simulated clock in one process."""

    def __init__(self, cfg: DriverConfig, learner: Learner, rollout: RolloutManager, *,
                 on_step: Optional[Callable[[dict], None]] = None, checkpoint_dir: Optional[str | Path] = None):
        super().__init__(cfg, learner, rollout, on_step=on_step, checkpoint_dir=checkpoint_dir)
        self._target = cfg.total_steps
        self.clock = 0
        self.publish: Optional[_Publish] = None

    def run(self, until_step: Optional[int] = None) -> list[dict]:
        """Run until the learner has consumed ``until_step`` batches (default: ``total_steps``)."""
        target = until_step if until_step is not None else self.cfg.total_steps
        self._target = target
        # the last update is published before returning, so the run ends at a checkpointable point
        while self.learner.step < target or self.publish is not None:
            if self.stop_reason is not None and self.learner.step == 0 and self.publish is None:
                self.stop_at_cut()  # nothing trained yet: stop at once, nothing to keep
            progressed, update_done = self._tick()
            if not progressed:
                raise RuntimeError(self._stall_report())
            if update_done and self.checkpoint_due():  # also after a step that trained only the critic
                self.save_checkpoint()
            if update_done and self.stop_reason is not None and self.learner.step < target:
                self.stop_at_cut()  # the cut a periodic checkpoint takes: a resumed run continues bit for bit
        self.rollout.release_env_threads()  # idle env workers exit; a later run() starts new ones
        return self.history

    def _tick(self) -> tuple[bool, bool]:
        """One tick: train if idle, generate one chunk, advance the clock, publish if due. Returns (progressed,
        an update finished this tick).

        A tick ends right after an update finishes (its publication, when the rollout engine has dropped its KV
        cache; or nothing to publish, when the step trained only the critic): that is the point where
        checkpoints are taken, so a resumed run re-does exactly what the original did.
        """
        progressed = update_done = False
        # trainer side: take a batch when idle --------------------------------------------------------
        if self.publish is None and self.learner.step < self._target:
            batch = self.take_batch()
            if batch is None and self._synchronous_round_short():
                # aborted members left this round short of B: train on what survived instead of waiting for
                # trajectories no launch will make (the next round launches once the buffer is empty)
                batch = self.buffer.take_batch(self.buffer.num_ready, self.learner.policy_version,
                                               self.cfg.staleness_cap)
            if batch is not None:
                self._train(batch)
                progressed = True
        if self.publish is not None:
            self.stats.trainer_busy_ticks += 1
            progressed = True  # the update is running; simulated time advances toward its publication
        # rollout side -------------------------------------------------------------------------------
        started = time.perf_counter()
        sync_blocked = self.cfg.synchronous and (self.publish is not None or self.buffer.num_ready >= self.batch_size)
        if self.cfg.synchronous and not sync_blocked and not self.launch_held and not self.rollout.busy and \
                self.rollout.inflight_trajectories == 0 and len(self.buffer) == 0:
            # one batch worth of prompts, all under the current weights (no overlap with training)
            while self.rollout.inflight_trajectories + self.rollout.group_size <= self.batch_size:
                for traj in self.rollout.launch_prompt():
                    self.intake(traj)
            progressed = True
        if not self.cfg.synchronous and not self.launch_held:
            while (self.rollout.inflight_trajectories + self.rollout.group_size <= self.max_inflight
                   and self.buffer.has_room(self.rollout.inflight_trajectories + self.rollout.group_size)):
                for traj in self.rollout.launch_prompt():
                    self.intake(traj)
                progressed = True
        if self.rollout.busy and not sync_blocked:
            self.stats.rollout_busy_ticks += 1
            for traj in self.rollout.advance(self.cfg.chunk_tokens):
                self.intake(traj)
            progressed = True
        self.time.rollout_busy_s += time.perf_counter() - started
        if self.switch is SwitchPhase.DRAINING and not self.kept_job_generating():
            self.install_single_rollout()
            progressed = True
        self.clock += 1
        self.stats.ticks += 1
        # publication: weights reach the rollout in flight (held while the Li2SAO switch drains) -------
        if self.publish is not None and self.clock >= self.publish.ready_at and self.switch is not SwitchPhase.DRAINING:
            if self.publish.weights is not None:
                self.rollout.engine.update_weights(self.publish.weights, self.publish.version)
            self.publish = None
            update_done = True
        return progressed, update_done

    def _synchronous_round_short(self) -> bool:
        """Synchronous baseline: the round is over (nothing live, no partial group) with fewer than B ready."""
        return (self.cfg.synchronous and 0 < self.buffer.num_ready < self.batch_size and not self.rollout.busy
                and self.rollout.inflight_trajectories == 0 and self.buffer.num_partial_groups == 0)

    def _train(self, batch) -> None:
        result, weights = self.train(batch)
        self.publish = _Publish(weights, self.learner.policy_version, self.clock + self.cfg.update_ticks)
        if result.gate_opened:
            self.begin_switch()
        metrics = result.metrics
        metrics.update(self.step_metrics())
        s = self.stats
        metrics.update({
            "async/buffer_ready": float(self.buffer.num_ready),
            "async/inflight_trajectories": float(self.rollout.inflight_trajectories),
            "async/clock_ticks": float(self.clock),
            # the simulated clock's view: ticks with no update running / without a generation chunk
            "sim/trainer_idle_frac": 1.0 - s.trainer_busy_ticks / max(s.ticks, 1),
            "sim/rollout_idle_frac": 1.0 - s.rollout_busy_ticks / max(s.ticks, 1),
        })
        self.record(metrics)

    # ------------------------------------------------------------------ checkpoint and resume
    def state_dict(self) -> dict:
        """Everything needed to continue bit for bit (taken at a tick boundary right after a publication)."""
        if self.publish is not None:
            raise RuntimeError("checkpoints are taken between an update's publication and the next batch")
        return {**self._run_state(self.rollout.engine.policy_version), "clock": self.clock}

    def load_state_dict(self, state: dict) -> None:
        self._load_run_state(state)
        self.clock = state["clock"]
        self.publish = None

    def _stall_report(self) -> str:
        return (
            "driver stalled: nothing to generate, no batch to train, nothing to publish. "
            f"buffer ready={self.buffer.num_ready} partial groups={self.buffer.num_partial_groups} "
            f"capacity={self.buffer.capacity}, inflight={self.rollout.inflight_trajectories}, "
            f"batch size={self.batch_size}, group size={self.rollout.group_size}, switch={self.switch.value}. "
            "Raise buffer_capacity / max_inflight_trajectories so one batch fits."
        )
