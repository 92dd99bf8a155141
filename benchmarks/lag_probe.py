"""Where a run's policy lag and simulated step time come from: a measurement probe for
``group_vs_single.py --long-tail`` (issue 22).

While the probe is open it wraps four driver methods (``RunCore.intake``, ``RunCore.take_batch``,
``RolloutManager.advance`` and ``TrajectoryBuffer.has_room``); it only reads versions, counters and slots,
so a run under the probe makes the same decisions, bit for bit on the simulated clock. Every model token's lag, trainer version at the
consuming update minus the token's version (``async/policy_lag/mean``, spec §1), splits exactly into

- ``generation``: publications the engine received while the rest of the token's trajectory generated;
- ``group_wait``: publications while the finished trajectory waited for its group's other members (the
  group barrier; 0 with n = 1);
- ``batch_wait``: publications from the group's release until the batch holding it is taken;
- ``update_in_flight``: the trainer's version minus the engine's when the batch is taken (an update not yet
  published; 0 when the trainer takes a batch only while idle, as the deterministic scheduler does).

Each component is averaged over a batch's model tokens and then over batches, as the run averages
``async/policy_lag/mean``; their sum is checked against it.

The simulated step time splits exactly as well: ticks / step = (tokens generated / step) /
(tokens / busy tick) / (busy ticks / tick), where a busy tick is one the rollout generated in, and tokens per
busy tick = live trajectories per chunk x tokens per live trajectory per chunk. ``slot_occupancy`` is the
mean number of live trajectories per chunk over the in-flight capacity; ``launches_refused_for_room`` counts
the times a scheduler had free slots for a group but the buffer had no room for it (the buffer counts live
trajectories against its capacity, and with groups it also holds finished members waiting for their siblings).
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from dataclasses import dataclass, field

COMPONENTS = ("generation", "group_wait", "batch_wait", "update_in_flight")


@dataclass
class _Stamp:
    engine_finish: int
    engine_release: int | None = None


@dataclass
class LagProbe:
    """Collects one run's lag components and slot counts (use :func:`probe` to open it around a run)."""

    batch_components: list[dict[str, float]] = field(default_factory=list)
    batch_lag: list[float] = field(default_factory=list)
    chunks: int = 0
    launches_refused_for_room: int = 0  # free slots for a group, but the buffer could not hold it on finishing
    live_per_chunk_sum: int = 0
    tokens_in_chunks: int = 0
    stamps: dict[str, _Stamp] = field(default_factory=dict)
    waiting: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    lock: threading.Lock = field(default_factory=threading.Lock)

    # ------------------------------------------------------------------ what the wrappers record
    def on_intake(self, driver, trajectory, added: bool, released: bool) -> None:
        version = driver.rollout.engine.policy_version
        with self.lock:
            self.stamps[trajectory.uid] = _Stamp(version)
            if not added:
                return
            self.waiting[trajectory.group_id].append(trajectory.uid)
            if released:
                for uid in self.waiting.pop(trajectory.group_id):
                    self.stamps[uid].engine_release = version

    def on_batch(self, driver, batch) -> None:
        trainer, engine = driver.learner.policy_version, driver.rollout.engine.policy_version
        sums = dict.fromkeys(COMPONENTS, 0.0)
        lag_sum = tokens = 0
        with self.lock:
            for t in batch:
                stamp = self.stamps.pop(t.uid)
                for v in t.model_versions():
                    sums["generation"] += stamp.engine_finish - v
                    sums["group_wait"] += stamp.engine_release - stamp.engine_finish
                    sums["batch_wait"] += engine - stamp.engine_release
                    sums["update_in_flight"] += trainer - engine
                    lag_sum += trainer - v
                    tokens += 1
            if tokens:
                self.batch_components.append({k: s / tokens for k, s in sums.items()})
                self.batch_lag.append(lag_sum / tokens)

    def on_chunk(self, live: int, tokens: int) -> None:
        with self.lock:
            self.chunks += 1
            self.live_per_chunk_sum += live
            self.tokens_in_chunks += tokens

    # ------------------------------------------------------------------ the report
    def summary(self, capacity: int, steps: int, ticks: int | None, generated_tokens: int) -> dict:
        n = max(len(self.batch_components), 1)
        components = {k: sum(b[k] for b in self.batch_components) / n for k in COMPONENTS}
        mean_lag = sum(self.batch_lag) / n
        out = {"lag_components": components, "lag_components_sum": sum(components.values()),
               "mean_policy_lag": mean_lag, "batches": len(self.batch_components)}
        if abs(out["lag_components_sum"] - mean_lag) > 1e-9:
            raise AssertionError(f"lag components sum to {out['lag_components_sum']}, not the lag {mean_lag}")
        live = self.live_per_chunk_sum / max(self.chunks, 1)
        out["slots"] = {
            "capacity": capacity,
            "live_per_chunk": live,
            "slot_occupancy": live / capacity,
            "tokens_per_live_per_chunk": self.tokens_in_chunks / max(self.live_per_chunk_sum, 1),
            "launches_refused_for_room": self.launches_refused_for_room,
        }
        if ticks is not None:  # the simulated clock's step-time factors (deterministic scheduler)
            out["step_time"] = {
                "ticks_per_step": ticks / steps,
                "tokens_generated_per_step": generated_tokens / steps,
                "tokens_per_busy_tick": self.tokens_in_chunks / max(self.chunks, 1),
                "busy_ticks_frac": self.chunks / ticks,
            }
        return out


@contextlib.contextmanager
def probe():
    """Open a :class:`LagProbe` on every driver built inside the ``with`` block (one run at a time)."""
    from async_rl.driver.buffer import TrajectoryBuffer
    from async_rl.driver.core import RunCore
    from async_rl.driver.rollout_manager import RolloutManager

    state = LagProbe()
    intake, take_batch, advance = RunCore.intake, RunCore.take_batch, RolloutManager.advance
    has_room = TrajectoryBuffer.has_room

    def probed_intake(self, trajectory):
        added, released = self.buffer.counters.added, self.buffer.counters.released_groups
        intake(self, trajectory)
        state.on_intake(self, trajectory, self.buffer.counters.added > added,
                        self.buffer.counters.released_groups > released)

    def probed_take_batch(self):
        batch = take_batch(self)
        if batch:
            state.on_batch(self, batch)
        return batch

    def probed_advance(self, chunk_tokens):
        live, before = len(self.episodes), self.generated_tokens  # the slots this chunk holds
        finished = advance(self, chunk_tokens)
        if live:
            state.on_chunk(live, self.generated_tokens - before)
        return finished

    def probed_has_room(self, n=1):
        room = has_room(self, n)
        if not room:  # the schedulers ask only once the slots are free
            with state.lock:
                state.launches_refused_for_room += 1
        return room

    RunCore.intake, RunCore.take_batch, RolloutManager.advance = probed_intake, probed_take_batch, probed_advance
    TrajectoryBuffer.has_room = probed_has_room
    try:
        yield state
    finally:
        RunCore.intake, RunCore.take_batch, RolloutManager.advance = intake, take_batch, advance
        TrajectoryBuffer.has_room = has_room
