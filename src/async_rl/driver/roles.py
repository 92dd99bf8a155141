"""The calls the learner makes on the models it trains: the contract every trainer role meets, in process
(``workers/roles.py``, ``workers/sapo.py``) or on Ray worker groups (``workers/remote.py``).

Structural types: a role satisfies a Protocol by having the methods, so the driver imports no worker, model or
engine code (tests/test_import_graph.py). Batches are collated dicts of ``(bs, T)`` tensors (``driver/batch.py``).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol, runtime_checkable

import torch


# read by the learner on every role: ``saves_sharded`` (True: the driver's checkpoints keep its state as shards,
# every rank its own) and ``world_size`` (its data-parallel ranks)
ROLE_ATTRIBUTES = ("saves_sharded", "world_size")


@runtime_checkable
class CheckpointedRole(Protocol):
    """The checkpoint calls the learner makes on every trained role, in process or on a worker group, and two
    attributes it reads (:data:`ROLE_ATTRIBUTES`; not declared here, so ``issubclass`` checks stay possible)."""

    def state_dict(self) -> dict[str, Any]:
        """``{"model", "optim"}``: full weights and optimizer state."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` saved at any world size."""

    def save_sharded(self, directory) -> dict[str, Any]:
        """Every rank writes its shard of model and optimizer state under ``directory``."""

    def load_sharded(self, directory) -> dict[str, Any]:
        """Load :meth:`save_sharded`'s shards, saved at this or another world size."""


@runtime_checkable
class PolicyRole(CheckpointedRole, Protocol):
    """The actor: one optimizer step with a registered verl policy loss (spec §2-§4)."""

    def update(self, batch: dict[str, torch.Tensor], advantages: torch.Tensor, loss_mode: str, clip_low: float,
               clip_high: float, dis_low: float, dis_high: float, loss_agg_mode: str = ...) -> dict[str, float]:
        """Train on ``batch`` with ``advantages`` ``(bs, T)`` and the policy loss named ``loss_mode``."""

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full weights for the rollout (what the driver publishes)."""


@runtime_checkable
class ValueRole(CheckpointedRole, Protocol):
    """The separate critic (LiSAO, Li2SAO, PPO; spec §3-§4)."""

    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """V_old ``(bs, T)``, frozen for the step."""

    def update(self, batch: dict[str, torch.Tensor], targets: torch.Tensor, mask: torch.Tensor,
               old_values: torch.Tensor, clip_eps: Optional[float] = ..., ranking: Optional[dict[str, Any]] = ...
               ) -> dict[str, float]:
        """One critic pass on ``targets`` under ``mask`` (clipped around ``old_values`` when ``clip_eps``)."""


@runtime_checkable
class SharedBackboneRole(CheckpointedRole, Protocol):
    """SAPO's one model: policy, V and Q readouts, its own joint loss (spec §5)."""

    def readouts(self, batch: dict[str, torch.Tensor], num_turns: int = ...) -> dict[str, torch.Tensor]:
        """Frozen V_old, Q_old (and their normalised readouts, the turn mask, old and reference log-probs) from
        one no-grad pass: the ``sapo_turn`` estimator's inputs."""

    def update(self, batch: dict[str, torch.Tensor], turns: Mapping[str, torch.Tensor],
               targets: Mapping[str, torch.Tensor], **coefficients: float) -> dict[str, float]:
        """One joint backward on policy, V and Q losses."""

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full weights for the rollout."""
