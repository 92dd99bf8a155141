"""What every rollout server keeps the same way (the hf standalone server in ``hf.py``, the hybrid server
in ``hybrid.py``, the vLLM server in ``vllm.py``): request counters, the broken state and its error, the
fields of ``ping`` and ``progress``, and ``abort_request``. Each server adds only how it generates. Also the
verl replica class of the servers that run in a process of their own (hf standalone, vLLM).
"""

from __future__ import annotations

import abc
import asyncio
import os
from typing import Any, Optional

from verl.workers.rollout.replica import RolloutMode, RolloutReplica

from async_rl.rollout.base import GenerationOutput


class ReplicaBrokenError(RuntimeError):
    """The replica's engine failed; every later call fails with this (the pool treats it as a dead replica)."""


class ServerBookkeeping(abc.ABC):
    """Counters, broken state and the shared verl server methods. ``describe`` names the server in errors
    (e.g. ``"hf replica 0 (pid 123)"``); ``extra_counters`` are the server's own counters."""

    def _init_bookkeeping(self, replica_rank: int, extra_counters: tuple[str, ...] = ()) -> None:
        self.replica_rank = int(replica_rank)
        self.counters = {key: 0 for key in ("requests", "finished", "aborted", "tokens", "weight_updates",
                                            "paused_requests", *extra_counters)}
        self.last_update_s = 0.0  # seconds the last weight update took
        self._broken: Optional[str] = None  # why the engine failed; None while healthy
        self._paused = False

    # ------------------------------------------------------------------ failure
    @abc.abstractmethod
    def describe(self) -> str:
        """The server in errors, e.g. ``"hf replica 0 (pid 123)"``."""

    def _broken_message(self) -> str:
        return f"{self.describe()}: {self._broken}"

    def _raise_if_broken(self) -> None:
        if self._broken is not None:
            raise ReplicaBrokenError(self._broken_message())

    # ------------------------------------------------------------------ bookkeeping
    def _count_delivered(self, output: GenerationOutput) -> None:
        self.counters["finished" if output.finish_reason != "aborted" else "aborted"] += 1
        self.counters["tokens"] += len(output.token_ids)

    def _ping_fields(self, pid: Optional[int], version: int, num_unfinished: int, device: Any,
                     stalled_s: float = 0.0) -> dict[str, Any]:
        """``ping``'s reply: health and progress (``stalled_s``: how long work has waited on a stuck engine)."""
        return {"pid": pid, "replica_rank": self.replica_rank, "version": int(version),
                "num_unfinished": int(num_unfinished), "paused": self._paused, "device": device,
                "counters": dict(self.counters), "last_update_s": self.last_update_s, "stalled_s": stalled_s}

    @staticmethod
    def _progress_entry(token_ids, logprobs, versions) -> dict[str, list]:
        """One unfinished request in ``progress``'s reply (while paused: exactly the prefix that resumes)."""
        return {"token_ids": list(token_ids), "logprobs": list(logprobs), "versions": list(versions)}

    # ------------------------------------------------------------------ verl server interface
    @abc.abstractmethod
    async def abort_requests(self, request_ids: list[Any]) -> dict[str, Any]:
        """Finish these requests as "aborted" (their ``generate`` calls return what they have)."""

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        return await self.abort_requests([request_id])


class OwnProcessReplica(RolloutReplica):
    """A verl ``RolloutReplica`` whose engine is one server actor of ours (``num_cpus`` CPUs, one GPU on CUDA),
    launched by :meth:`init_standalone` instead of verl's GPU bundles: the hf and vLLM replicas."""

    KIND = "rollout"  # the engine's name in actor names and errors
    ray_resources: dict[str, float] = {}  # custom Ray resources the server also reserves (e.g. to pin it to a node)

    def _own_process_settings(self, device: str, num_cpus: float, initial_version: int, name_prefix: str,
                              start_timeout_s: float) -> None:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"rollout device must be cpu or cuda, got {device!r}")
        self.device, self.num_cpus, self.initial_version = device, num_cpus, initial_version
        self.name_prefix, self.start_timeout_s = name_prefix, start_timeout_s

    def rollout_worker_use_gpu(self) -> bool:
        return self.device == "cuda"

    async def init_standalone(self) -> None:
        self.rollout_mode = RolloutMode.STANDALONE
        await self.launch_servers()

    async def _start_own_server(self, server_cls: type, ready_method: str, *args: Any, **kwargs: Any) -> Any:
        """Start the server actor and wait for ``ready_method`` (constructor errors surface there); one that Ray
        cannot schedule, or that does not answer in ``start_timeout_s``, is killed with an error naming what it
        needs. The server is this replica's only server and its checkpoint-engine worker."""
        import ray

        server = ray.remote(server_cls).options(
            name=f"{self.name_prefix}_{self.KIND}_server_{self.replica_rank}_{os.getpid()}_{id(self) & 0xffff:x}",
            max_concurrency=self.max_concurrency, num_cpus=self.num_cpus,
            num_gpus=1 if self.device == "cuda" else 0, resources=dict(self.ray_resources) or None,
        ).remote(*args, **kwargs)
        try:
            await asyncio.wait_for(getattr(server, ready_method).remote(), timeout=self.start_timeout_s)
        except asyncio.TimeoutError:
            ray.kill(server, no_restart=True)
            raise RuntimeError(
                f"{self.KIND} replica {self.replica_rank} did not start within {self.start_timeout_s:g} s (it needs "
                f"{self.num_cpus:g} CPU{' and 1 GPU' if self.device == 'cuda' else ''}"
                f"{f' and {self.ray_resources}' if self.ray_resources else ''}; Ray has "
                f"{ray.available_resources()}); start Ray with more CPUs or lower rollout.cpus_per_replica") from None
        except BaseException:
            ray.kill(server, no_restart=True)
            raise
        self.servers = [server]
        self._server_handle = server
        self.workers = [server]  # verl's CheckpointEngineManager talks to the server itself
        return server

    async def update_weights(self, published: dict[str, Any], version: int) -> dict[str, float]:
        results = await asyncio.gather(*[s.update_weights.remote(published, version) for s in self.servers])
        return results[0]
