"""The verl ``RolloutReplica`` classes and the engine lookup (it imports the servers in ``servers/``; none of them
imports this module; :mod:`async_rl.rollout.launch` starts them). Standalone replicas by engine
(:class:`HFReplica`, :class:`~async_rl.rollout.servers.vllm.VLLMReplica`); :class:`HybridReplica` for
``rollout.mode=hybrid`` whatever engine the train ranks hold."""

from __future__ import annotations

import asyncio
import os
from typing import Any, Optional

import ray
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry

from async_rl.rollout.servers.base import OwnProcessReplica, ReplicaBrokenError
from async_rl.rollout.servers.hf import HFRolloutServer
from async_rl.rollout.servers.hybrid import HybridServer
from async_rl.rollout.servers.vllm import VLLMReplica
from async_rl.rollout.settings import ENGINE_NAMES, require_vllm


class HFReplica(OwnProcessReplica):
    """verl ``RolloutReplica`` for the transformers engine (registered as ``"hf"``), ``rollout.mode=standalone``.

    :meth:`init_standalone`: verl's version asks for GPU bundles and a ``CheckpointEngineWorker``; we override it to
    launch one :class:`HFRolloutServer` actor with ``num_cpus`` CPUs (and one GPU when ``device="cuda"``), because
    this engine loads weights in its own process. Tensor/pipeline/data parallelism inside a replica is not supported
    (one process per replica): ``config.tensor_model_parallel_size`` etc. must be 1.
    """

    KIND = "hf"

    def __init__(self, replica_rank: int, config, model_config, gpus_per_node: int = 1, *, device: str = "cpu",
                 dtype: Optional[str] = None, torch_threads: Optional[int] = 1, chunk_tokens: int = 4,
                 num_cpus: float = 1.0, initial_version: int = 0, name_prefix: str = "async_rl",
                 start_timeout_s: float = 600.0) -> None:
        super().__init__(replica_rank, config, model_config, gpus_per_node=max(1, gpus_per_node))
        if self.world_size != 1:
            raise ValueError(f"rollout.engine=hf runs one process per replica: set tensor/data/pipeline parallel "
                             f"sizes to 1 (got world size {self.world_size}); use more replicas instead")
        self._own_process_settings(device, num_cpus, initial_version, name_prefix, start_timeout_s)
        self.dtype = dtype
        self.torch_threads = torch_threads
        self.chunk_tokens = chunk_tokens

    async def launch_servers(self) -> None:
        model_path = getattr(self.model_config, "local_path", None) or getattr(self.model_config, "path")
        await self._start_own_server(
            HFRolloutServer, "ping", str(model_path), replica_rank=self.replica_rank, device=self.device,
            dtype=self.dtype, torch_threads=self.torch_threads, chunk_tokens=self.chunk_tokens,
            initial_version=self.initial_version, checkpoint_backend=self.config.checkpoint_engine.backend,
            checkpoint_bucket_megabytes=self.config.checkpoint_engine.update_weights_bucket_megabytes)


class HybridReplica(RolloutReplica):
    """verl ``RolloutReplica`` for ``rollout.mode=hybrid``, any engine: the engine (hf or vLLM) is the RolloutWorker
    fused into train rank ``replica_rank``'s process, and one :class:`~async_rl.rollout.servers.hybrid.HybridServer` serves
    it. verl's :meth:`init_hybrid` (unchanged) keeps this replica's slice of the fused train workers in
    ``self.workers`` and calls :meth:`launch_servers`."""

    KIND = "hybrid"

    def __init__(self, replica_rank: int, config, model_config, gpus_per_node: int = 1, *, chunk_tokens: int = 4,
                 name_prefix: str = "async_rl", start_timeout_s: float = 600.0, engine: Optional[str] = None) -> None:
        super().__init__(replica_rank, config, model_config, gpus_per_node=max(1, gpus_per_node))
        self.chunk_tokens, self.name_prefix, self.start_timeout_s = chunk_tokens, name_prefix, start_timeout_s
        self.engine = engine  # the engine the run asked for; the rank's RolloutWorker must hold it

    async def init_standalone(self) -> None:
        raise RuntimeError("a hybrid replica lives in a train rank: start it with init_hybrid(worker_group)")

    async def launch_servers(self) -> None:
        """One :class:`~async_rl.rollout.servers.hybrid.HybridServer` (no CPU reserved, on the train rank's node) in front
        of the RolloutWorker fused into that rank's process."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if self.rollout_mode != RolloutMode.HYBRID:
            raise RuntimeError("HybridReplica serves rollout.mode=hybrid only (init_hybrid)")
        if len(self.workers) != 1:
            raise ValueError(f"hybrid replica {self.replica_rank} runs on one train rank, got {len(self.workers)}")
        worker = self.workers[0]
        node = await worker.__ray_call__.remote(lambda actor: ray.get_runtime_context().get_node_id())
        server = ray.remote(HybridServer).options(
            name=f"{self.name_prefix}_hybrid_server_{self.replica_rank}_{os.getpid()}_{id(self) & 0xffff:x}",
            max_concurrency=self.max_concurrency, num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
        ).remote(worker, replica_rank=self.replica_rank, chunk_tokens=self.chunk_tokens)
        try:
            info = await asyncio.wait_for(server.ping.remote(), timeout=self.start_timeout_s)
        except asyncio.TimeoutError:
            ray.kill(server, no_restart=True)
            raise RuntimeError(f"hybrid replica {self.replica_rank} did not answer within "
                               f"{self.start_timeout_s:g} s (its train rank is busy or gone)") from None
        except ReplicaBrokenError as error:
            ray.kill(server, no_restart=True)
            raise RuntimeError(f"rollout.mode=hybrid: train rank {self.replica_rank} has no rollout engine to serve "
                               f"({str(error).splitlines()[-1]}); build the train workers with "
                               f"make_worker_groups('colocated', ...), which fuses a RolloutWorker into every "
                               f"rank") from error
        if self.engine is not None and info.get("engine") != self.engine:
            ray.kill(server, no_restart=True)
            raise RuntimeError(f"rollout.engine={self.engine} but train rank {self.replica_rank}'s rollout engine is "
                               f"{info.get('engine')}: build the colocated groups with rollout_kwargs={{'engine': "
                               f"'{self.engine}'}}")
        self.servers = [server]
        self._server_handle = server

    async def update_weights(self, published: dict[str, Any], version: int) -> dict[str, float]:
        return await self._server_handle.update_weights.remote(published, version)


def _load_hf() -> type[RolloutReplica]:
    return HFReplica


# async_rl.verl_plugin registers "hf" (lazily) whenever async_rl is imported or verl loads its plugins; this keeps
# the name available even if that registration was bypassed
if "hf" not in RolloutReplicaRegistry._registry:
    RolloutReplicaRegistry.register("hf", _load_hf)


def replica_class(engine: str) -> type[RolloutReplica]:
    """verl's registry lookup with an install hint for engines that are not installed here."""
    if engine not in ENGINE_NAMES:
        raise ValueError(f"rollout.engine={engine!r}; valid choices: {', '.join(ENGINE_NAMES)}")
    if engine == "vllm":  # our AsyncLLM server, not verl's vLLMReplica (docs/rollout.md, "vLLM")
        require_vllm()
        return VLLMReplica
    try:
        return RolloutReplicaRegistry.get(engine)
    except (ImportError, ValueError) as error:  # verl's vllm shim raises ValueError("vllm version None ...")
        raise RuntimeError(f"rollout.engine={engine} needs the {engine} package, which is not installed here "
                           f"({error}); install the GPU profile with `make install-gpu ENGINE={engine}` on a CUDA "
                           f"machine, or use rollout.engine=hf") from error


__all__ = ["HFReplica", "HybridReplica", "replica_class"]
