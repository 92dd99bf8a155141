"""Start rollout replicas: :func:`launch_replicas` builds ``N`` replicas of an engine through verl's registry, standalone
(each in its own process, optionally pinned to nodes by custom Ray resources) or hybrid (inside the train ranks),
after checking that Ray can place them. The driver then streams to them through a
:class:`~async_rl.rollout.pool.ReplicaPool`.

Details: docs/rollout.md (7, "Registry"; 8, hybrid; "Replicas on other nodes").
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import ray
from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig

from async_rl.rollout.checkpoint_engine import BACKEND_NAME
from async_rl.rollout.replicas import HFReplica, HybridReplica, replica_class
from async_rl.rollout.settings import ROLLOUT_MODES, ReplicaSettings


def _check_resources_exist(replica_resources: Sequence[Optional[Mapping[str, float]]], num_cpus: float) -> None:
    """A pinned replica that no node can hold would wait forever: refuse it now, naming the nodes' resources (a
    typo, a node that has not joined yet, or a node without the CPUs ``rollout.cpus_per_replica`` asks for).
    Checked per replica against each alive node, and per resource against the whole cluster."""
    standard = {"CPU", "GPU", "memory", "object_store_memory"}
    nodes = [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")]

    def described(resources: Mapping[str, float]) -> str:
        shown = {name: amount for name, amount in resources.items() if name == "CPU" or (
            name not in standard and not name.startswith("node:") and not name.startswith("accelerator_type:"))}
        return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in sorted(shown.items())) + "}"

    nodes_text = "; ".join(described(node) for node in nodes) or "none"
    totals: dict[str, float] = {}
    for index, resources in enumerate(replica_resources):
        if not resources:
            continue
        needed = {**{name: float(amount) for name, amount in resources.items()},
                  **({"CPU": float(num_cpus)} if num_cpus > 0 else {})}
        for name, amount in resources.items():
            totals[name] = totals.get(name, 0.0) + float(amount)
        if not any(all(node.get(name, 0.0) >= amount for name, amount in needed.items()) for node in nodes):
            first = next(iter(resources))
            raise ValueError(
                f"rollout.replica_resources[{index}]={dict(resources)} with rollout.cpus_per_replica={num_cpus:g}: no "
                f"node of this Ray cluster has all of {described(needed)} (its nodes: {nodes_text}). Start one with "
                f"ray start --address=<head> --resources='{{\"{first}\": {max(1, int(resources[first]))}}}' "
                f"--num-cpus={max(1, math.ceil(num_cpus)) if num_cpus > 0 else 0}, or lower rollout.cpus_per_replica")
    available = {}
    for node in nodes:
        for name, amount in node.items():
            available[name] = available.get(name, 0.0) + amount
    for name, amount in totals.items():
        if available.get(name, 0.0) < amount:
            raise ValueError(f"rollout.replica_resources asks for {amount:g} of Ray resource {name!r} in all, but "
                             f"this cluster has {available.get(name, 0.0):g} (its nodes: {nodes_text})")


def launch_replicas(engine: str, num_replicas: int, model_path: str, *, device: str = "cpu",
                    dtype: Optional[str] = None, torch_threads: Optional[int] = 1, chunk_tokens: int = 4,
                    num_cpus: float = 1.0, max_model_len: Optional[int] = None,
                    name_prefix: str = "async_rl", mode: str = "standalone",
                    worker_group: Optional[Any] = None, checkpoint_backend: str = "ray_object_store",
                    checkpoint_bucket_megabytes: int = 2048, kv_on_update: str = "recompute",
                    engine_options: Optional[dict] = None,
                    replica_resources: Optional[Sequence[Optional[Mapping[str, float]]]] = None) -> list[Any]:
    """Build ``num_replicas`` replicas of ``engine`` through verl's registry and start them.

    ``mode="standalone"``: each replica in its own process(es) (``init_standalone``). ``mode="hybrid"`` (hf or
    vllm): replica ``r`` serves the rollout engine fused into train rank ``r`` of ``worker_group`` (verl's
    ``init_hybrid``; the fused group of ``make_worker_groups("colocated", ...)``, whose RolloutWorkers were built for
    ``engine``), so ``num_replicas`` must equal its world size; ``device``/``dtype``/``num_cpus`` and the engine
    options are then the train workers' own.
    ``replica_resources[r]``: custom Ray resources replica ``r``'s server actor also reserves (hf and vllm,
    standalone), e.g. ``{"rollout_node_1": 1}`` to pin it to the node that was started with that resource.
    """
    if num_replicas < 1:
        raise ValueError(f"rollout.replicas must be >= 1, got {num_replicas}")
    if mode not in ROLLOUT_MODES:
        raise ValueError(f"rollout.mode={mode!r}; valid choices: {', '.join(ROLLOUT_MODES)}")
    if replica_resources is not None:  # the config-time rules (one per replica, amounts > 0), then the live nodes
        ReplicaSettings(engine=engine, replicas=num_replicas, mode=mode,
                        replica_resources=list(replica_resources))._check_replica_resources()
        _check_resources_exist(replica_resources, float(num_cpus))
    if mode == "hybrid":
        if worker_group is None:
            raise ValueError("rollout.mode=hybrid needs the train worker group the replicas live in (worker_group=)")
        ReplicaSettings(engine=engine, replicas=num_replicas, mode=mode).validate()  # hf or vllm, else the reason
        ReplicaSettings(engine=engine, replicas=num_replicas, mode=mode).check_placement(len(worker_group.workers))
    cls = HybridReplica if mode == "hybrid" else replica_class(engine)
    # vLLM/SGLang replicas receive weights in their CheckpointEngineWorker through the configured engine (ours by default);
    # custom_backend_module makes verl import (and so register) it inside those workers
    checkpoint = CheckpointEngineConfig(backend=checkpoint_backend or BACKEND_NAME,
                                        update_weights_bucket_megabytes=int(checkpoint_bucket_megabytes),
                                        custom_backend_module="async_rl.rollout.checkpoint_engine")
    config = RolloutConfig(name=engine, mode="async", tensor_model_parallel_size=1, data_parallel_size=1,
                           pipeline_model_parallel_size=1, max_model_len=max_model_len, checkpoint_engine=checkpoint)
    model_config = HFModelConfig(path=str(model_path))
    if mode == "hybrid":
        replicas = [cls(rank, config, model_config, chunk_tokens=chunk_tokens, name_prefix=name_prefix, engine=engine)
                    for rank in range(num_replicas)]

        async def start_hybrid() -> None:
            await asyncio.gather(*[replica.init_hybrid(worker_group) for replica in replicas])
        asyncio.run(start_hybrid())
        return replicas
    if cls is HFReplica or issubclass(cls, HFReplica):
        free = ray.available_resources().get("CPU", 0.0)
        if free + 1e-9 < num_replicas * num_cpus:
            raise RuntimeError(f"{num_replicas} hf replicas need {num_replicas * num_cpus:g} logical Ray CPUs "
                               f"(rollout.cpus_per_replica={num_cpus:g}) but Ray has {free:g} free; start Ray with "
                               f"more (ray.init(num_cpus=...)) or lower rollout.cpus_per_replica")
        replicas = [cls(rank, config, model_config, device=device, dtype=dtype, torch_threads=torch_threads,
                        chunk_tokens=chunk_tokens, num_cpus=num_cpus, name_prefix=name_prefix)
                    for rank in range(num_replicas)]
    elif engine == "vllm":  # our AsyncLLM server (async_rl.rollout.servers.vllm)
        replicas = [cls(rank, config, model_config, device=device, num_cpus=num_cpus, kv_on_update=kv_on_update,
                        engine_options={**(engine_options or {}), "dtype": dtype,
                                        "max_model_len": (engine_options or {}).get("max_model_len") or max_model_len},
                        name_prefix=name_prefix)
                    for rank in range(num_replicas)]
    else:  # verl's own SGLangReplica, unchanged
        replicas = [cls(rank, config, model_config, gpus_per_node=1) for rank in range(num_replicas)]

    for replica, resources in zip(replicas, replica_resources or ()):
        replica.ray_resources = dict(resources or {})

    async def start_all() -> None:
        await asyncio.gather(*[replica.init_standalone() for replica in replicas])
    asyncio.run(start_all())
    return replicas


__all__ = ["launch_replicas"]
