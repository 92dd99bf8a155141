"""``trainer.driver.*`` of the config as :class:`DriverConfig`.

No torch here: ``python -m async_rl.train`` validates these settings before any heavy import
(``async_rl.driver.core`` and ``async_rl.driver.driver`` re-export the class).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


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

    def validate(self, batch_size: int, group_size: int = 1) -> None:
        """Types and ranges of every field (one line naming ``trainer.driver.<key>``, the value and what is
        allowed), then the capacities against one batch of ``batch_size`` trajectories sampled in groups of
        ``group_size``."""
        from async_rl.validation import ConfigError, check_dataclass

        check_dataclass(self, "trainer.driver", self.RANGES)
        # the buffer counts live trajectories against its room: when an aborted member leaves the ready groups
        # one short of a batch, one more group must still fit, or neither a launch nor a batch can happen
        need = batch_size + group_size - 1
        if self.buffer_capacity is not None and self.buffer_capacity < need:
            raise ConfigError(
                f"trainer.driver.buffer_capacity={self.buffer_capacity}: must hold at least one batch ({batch_size} "
                f"trajectories) plus one group less a member (group size {group_size}): set it to {need} or "
                "more, or null (4 x the batch)")
