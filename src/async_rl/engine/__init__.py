"""Training engines: a model + optimizer, possibly sharded over data-parallel ranks.

Public API::

    from async_rl.engine import FSDPEngine, OptimizerConfig, TrainEngine, GlobalDenominator
    from async_rl.engine import TrainingSettings, MicroBatchPlan   # precision / token budget / checkpointing
    from async_rl.engine import dist   # device / backend / process-group helpers

See ``docs/engine.md``.
"""

from async_rl.engine import dist
from async_rl.engine.base import GlobalDenominator, OptimizerConfig, TrainEngine
from async_rl.engine.fsdp import FSDPEngine, enable_activation_checkpointing, find_shard_units
from async_rl.engine.microbatch import MicroBatchPlan, pack_rows
from async_rl.engine.settings import TrainingSettings

__all__ = [
    "FSDPEngine",
    "GlobalDenominator",
    "MicroBatchPlan",
    "OptimizerConfig",
    "TrainEngine",
    "TrainingSettings",
    "dist",
    "enable_activation_checkpointing",
    "find_shard_units",
    "pack_rows",
]
