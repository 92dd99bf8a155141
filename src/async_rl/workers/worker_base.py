"""What every worker of ours shares: thread count, process group, health check."""

from __future__ import annotations

import os
import time
from typing import Any, Optional

import torch
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

from async_rl.engine import dist


class RoleWorker(Worker):
    """Shared plumbing: thread count, process group, health check."""

    def __init__(self, torch_threads: Optional[int] = 1, device: Optional[str] = None,
                 dist_timeout_s: float = 600.0):
        super().__init__()
        if torch_threads:
            torch.set_num_threads(int(torch_threads))
        self.device_type = device
        self.dist_timeout_s = dist_timeout_s
        self.dist_ctx: Optional[dist.DistContext] = None

    def _init_distributed(self) -> dist.DistContext:
        # verl's Worker put RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (one rendezvous per worker group)
        # in the environment; the backend follows the device (gloo on CPU, NCCL on CUDA).
        self.dist_ctx = dist.init_distributed(device=self.device_type, timeout_s=self.dist_timeout_s)
        return self.dist_ctx

    def _require_model(self):
        if getattr(self, "role", None) is None:
            raise RuntimeError(f"{type(self).__name__} rank {self.rank}: call init_model() first")

    def _sibling(self, role: str):
        """Another role fused into this process (colocated placement), else ``None``."""
        return (getattr(self, "fused_worker_dict", None) or {}).get(role)

    def _free_colocated_rollout_cache(self) -> None:
        """A training call is about to use this process's device: the fused rollout engine (colocated placement,
        ``rollout.mode=hybrid``) drops its KV cache; its requests keep their tokens and are re-prefilled when it
        runs again (verl's hybrid engine sleeps its rollout the same way around updates)."""
        engine = getattr(self._sibling("rollout"), "engine", None)
        if engine is not None:
            engine.release_cache()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ping(self, sleep_s: float = 0.0) -> dict[str, Any]:
        """Health check: who and where this worker is (``sleep_s`` delays the answer)."""
        if sleep_s:
            time.sleep(sleep_s)
        return {"class": type(self).__name__, "rank": self.rank, "world_size": self.world_size,
                "pid": os.getpid(), "device": str(dist.current_device()),
                "backend": self.dist_ctx.backend if self.dist_ctx else None,
                "torch_threads": torch.get_num_threads()}
