"""The staleness-capped trajectory buffer with a group barrier (spec §1, §2).

- A finished trajectory enters at once. Members of a prompt group wait until the whole group finished
  (the synchronisation barrier GRPO pays, spec §2); singleton groups are released immediately.
- The trainer takes whole groups, oldest first, up to ``B`` trajectories.
- Staleness cap ``k`` (per token): before a batch is handed out, every released group holding a token
  with ``trainer_version - v_t > k`` is dropped and its trajectories are counted in ``dropped_stale``
  (a group is dropped whole: removing one member would change the others' group advantage).
- Aborted trajectories (env or sandbox failure) are never trained on: they are removed from their group
  when it is released and counted in ``aborted``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from async_rl.driver.trajectory import Trajectory


@dataclass
class BufferCounters:
    added: int = 0
    released_groups: int = 0
    dropped_stale: int = 0
    aborted: int = 0
    discarded: int = 0  # thrown away by a protocol step (Li2SAO switch)


class TrajectoryBuffer:
    """Bounded buffer of finished trajectories, released to the trainer as whole prompt groups."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._partial: OrderedDict[str, list[Trajectory]] = OrderedDict()  # groups still waiting for members
        self._ready: deque[list[Trajectory]] = deque()  # complete groups, oldest first
        self.counters = BufferCounters()

    # ------------------------------------------------------------------ filling
    def __len__(self) -> int:
        return sum(len(g) for g in self._partial.values()) + sum(len(g) for g in self._ready)

    def has_room(self, n: int = 1) -> bool:
        return len(self) + n <= self.capacity

    def add(self, trajectory: Trajectory) -> None:
        if len(self) >= self.capacity:
            raise OverflowError(
                f"trajectory buffer is full ({self.capacity}); the driver must stop launching prompts "
                "when has_room() is False (raise buffer_capacity or lower max_inflight_prompts)"
            )
        self.counters.added += 1
        members = self._partial.setdefault(trajectory.group_id, [])
        members.append(trajectory)
        if len(members) >= trajectory.group_size:
            del self._partial[trajectory.group_id]
            self._release(members)

    def _release(self, members: list[Trajectory]) -> None:
        valid = [t for t in members if not t.aborted]
        self.counters.aborted += len(members) - len(valid)
        if valid:
            self._ready.append(valid)
            self.counters.released_groups += 1

    # ------------------------------------------------------------------ draining
    @property
    def num_ready(self) -> int:
        return sum(len(g) for g in self._ready)

    @property
    def num_partial_groups(self) -> int:
        return len(self._partial)

    def drop_stale(self, trainer_version: int, staleness_cap: int) -> int:
        """Drop released groups holding any token with lag > ``staleness_cap``; returns trajectories dropped."""
        if staleness_cap < 0:
            raise ValueError(f"staleness_cap must be >= 0, got {staleness_cap}")
        kept: deque[list[Trajectory]] = deque()
        dropped = 0
        for group in self._ready:
            if any(t.max_lag(trainer_version) > staleness_cap for t in group):
                dropped += len(group)
            else:
                kept.append(group)
        self._ready = kept
        self.counters.dropped_stale += dropped
        return dropped

    def take_batch(self, batch_size: int, trainer_version: int, staleness_cap: int) -> list[Trajectory] | None:
        """Whole groups, oldest first, at most ``batch_size`` trajectories; None until enough are ready.

        Stale groups are dropped first (counted). A batch never mixes group sizes: groups of another
        size than the oldest ready group's wait for a later batch.
        """
        self.drop_stale(trainer_version, staleness_cap)
        if self.num_ready < batch_size:
            return None
        size = self._ready[0][0].group_size
        batch: list[Trajectory] = []
        rest: deque[list[Trajectory]] = deque()
        while self._ready:
            group = self._ready.popleft()
            if group[0].group_size == size and len(batch) + len(group) <= batch_size:
                batch.extend(group)
            else:
                rest.append(group)
        self._ready = rest
        return batch

    def group_ids_oldest_first(self) -> list[str]:
        """Released groups (oldest first), then groups still waiting for members."""
        return [g[0].group_id for g in self._ready] + list(self._partial)

    def discard_except(self, keep_group_ids: set[str]) -> int:
        """Drop every group (released or partial) not in ``keep_group_ids``; returns trajectories dropped."""
        before = len(self)
        self._ready = deque(g for g in self._ready if g[0].group_id in keep_group_ids)
        self._partial = OrderedDict((gid, m) for gid, m in self._partial.items() if gid in keep_group_ids)
        dropped = before - len(self)
        self.counters.discarded += dropped
        return dropped

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        return {
            "capacity": self.capacity,
            "partial": [[t.to_dict() for t in g] for g in self._partial.values()],
            "ready": [[t.to_dict() for t in g] for g in self._ready],
            "counters": vars(self.counters).copy(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.capacity = state["capacity"]
        self._partial = OrderedDict()
        for group in state["partial"]:
            members = [Trajectory.from_dict(t) for t in group]
            self._partial[members[0].group_id] = members
        self._ready = deque([Trajectory.from_dict(t) for t in g] for g in state["ready"])
        self.counters = BufferCounters(**state["counters"])
