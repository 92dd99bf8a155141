"""``trainer.driver.*`` of the config as :class:`DriverConfig`.

No torch here: ``python -m async_rl.train`` validates these settings before any heavy import
(``async_rl.driver.core`` and ``async_rl.driver.driver`` re-export the class).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from async_rl.validation import ConfigError, check_settings, setting, settings_from_mapping


@dataclass
class DriverConfig:
    """``trainer.driver.*``: every field a :func:`~async_rl.validation.setting` (type, default, range, meaning)."""

    total_steps: int = setting(100, "optimizer batches to train", range=">= 1")
    staleness_cap: int = setting(4, "k, spec §1: drop trajectories holding a token with policy lag > k (0 = strictly "
                                    "on-policy)", range=">= 0")
    max_inflight_trajectories: Optional[int] = setting(None, "live episodes the rollout keeps going; null = 2 B",
                                                       range=">= 1")
    buffer_capacity: Optional[int] = setting(None, "finished trajectories held (live ones count against its room); at "
                                                   "least B + n - 1; null = 4 B", range=">= 1")
    chunk_tokens: int = setting(8, "tokens generated per scheduler tick (weights can change between chunks)",
                                range=">= 1")
    update_ticks: int = setting(4, "deterministic scheduler: simulated duration of one trainer update, in ticks",
                                range=">= 0")
    checkpoint_every: int = setting(0, "save a checkpoint every this many steps (0 = never)", range=">= 0")
    keep_last: int = setting(3, "checkpoints kept on disk (older ones are deleted); >= 2 leaves one to fall back to",
                             range=">= 1")
    synchronous: bool = setting(False, "colocated synchronous baseline: generate one batch, train, publish, repeat")

    @classmethod
    def from_dict(cls, data: dict) -> "DriverConfig":
        """From a plain dict (the resolved ``trainer.driver`` node); unknown keys fail with the valid ones."""
        return settings_from_mapping(cls, data, "trainer.driver")

    def validate(self, batch_size: int, group_size: int = 1) -> None:
        """Types and ranges of every field (one line naming ``trainer.driver.<key>``, the value and what is
        allowed), then the capacities against one batch of ``batch_size`` trajectories sampled in groups of
        ``group_size``."""
        check_settings(self, "trainer.driver")
        # the buffer counts live trajectories against its room: when an aborted member leaves the ready groups
        # one short of a batch, one more group must still fit, or neither a launch nor a batch can happen
        need = batch_size + group_size - 1
        if self.buffer_capacity is not None and self.buffer_capacity < need:
            raise ConfigError(
                f"trainer.driver.buffer_capacity={self.buffer_capacity}: must hold at least one batch ({batch_size} "
                f"trajectories) plus one group less a member (group size {group_size}): set it to {need} or "
                "more, or null (4 x the batch)")
