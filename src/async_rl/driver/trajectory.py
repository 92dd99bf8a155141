"""A trajectory as the driver stores it: segments of model tokens (with behaviour log-probs and policy
versions) and environment tokens (without), plus the outcome (spec §1, issue: multi-turn support).

Plain Python lists: trajectories travel between processes and into checkpoints; tensors are built only
when a batch is collated (:func:`async_rl.driver.batch.collate`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

OBSERVATION_VERSION = -1  # version recorded on environment tokens (never sampled by a policy)


@dataclass
class Segment:
    """A run of response tokens from one source.

    ``kind == "model"``: generated tokens, each with its behaviour log-prob and policy version.
    ``kind == "env"``: observation / chat-wrapper tokens appended by the environment (no loss on them).
    """

    kind: str  # "model" | "env"
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn: int = 0  # index of the turn this segment belongs to

    def __post_init__(self):
        if self.kind not in ("model", "env"):
            raise ValueError(f"segment kind must be 'model' or 'env', got {self.kind!r}")
        if self.kind == "model" and not (len(self.token_ids) == len(self.logprobs) == len(self.versions)):
            raise ValueError("a model segment needs one log-prob and one version per token")


@dataclass
class Trajectory:
    """One episode: prompt, response segments, and outcome.

    ``group_id`` joins responses to the same prompt (GRPO / Li2SAO bootstrap); ``uid`` is unique.
    ``aborted`` marks an env/sandbox failure: such a trajectory is never trained on (spec §1).
    """

    uid: str
    group_id: str
    prompt_index: int  # position of the prompt in the data stream (for resume: no prompt lost or repeated)
    prompt_ids: list[int]
    segments: list[Segment] = field(default_factory=list)
    reward: float = 0.0
    success: bool = False
    aborted: bool = False
    abort_reason: Optional[str] = None
    num_turns: int = 0
    turn_rewards: list[float] = field(default_factory=list)
    turn_dones: list[bool] = field(default_factory=list)
    turn_invalid: list[bool] = field(default_factory=list)
    truncated: bool = False  # hit max turns / max tokens without the env saying done
    group_size: int = 1  # size of the group this trajectory was sampled in
    info: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ flattened views
    @property
    def response_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    @property
    def response_mask(self) -> list[int]:
        return [1 if s.kind == "model" else 0 for s in self.segments for _ in s.token_ids]

    @property
    def behaviour_logprobs(self) -> list[float]:
        return [lp for s in self.segments for lp in (s.logprobs if s.kind == "model" else [0.0] * len(s.token_ids))]

    @property
    def versions(self) -> list[int]:
        return [v for s in self.segments
                for v in (s.versions if s.kind == "model" else [OBSERVATION_VERSION] * len(s.token_ids))]

    @property
    def token_turn_index(self) -> list[int]:
        return [s.turn if s.kind == "model" else -1 for s in self.segments for _ in s.token_ids]

    @property
    def num_model_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments if s.kind == "model")

    def model_versions(self) -> list[int]:
        return [v for s in self.segments if s.kind == "model" for v in s.versions]

    def max_lag(self, trainer_version: int) -> int:
        """Largest per-token policy lag (spec §1); 0 for a trajectory without model tokens."""
        versions = self.model_versions()
        return trainer_version - min(versions) if versions else 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Trajectory":
        data = dict(data)
        data["segments"] = [Segment(**s) for s in data["segments"]]
        return cls(**data)
