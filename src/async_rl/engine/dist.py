"""Device and process-group selection, in one place.

Every other module asks this one which device to compute on and which collective backend to use
(:func:`pick_device`, :func:`pick_backend`, :func:`current_device`, :func:`init_distributed`): ``cuda:i`` with
NCCL where CUDA is available (``i`` = :func:`local_rank`), else CPU with gloo. Everything here is safe
to call without a process group: the helpers then describe a single process (rank 0 of world size 1)
and collectives (:func:`all_reduce_sum`, ...) are no-ops.

Details: docs/engine.md (§1 Device and backend selection).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as torch_dist


def pick_device() -> str:
    """Return the device *type* to train on: ``"cuda"`` if CUDA is usable, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_backend(device: str | torch.device) -> str:
    """Return the collective backend for a device type: ``"nccl"`` for CUDA, ``"gloo"`` for CPU.

    Raises:
        ValueError: for a device type with no supported backend here (e.g. ``"mps"``).
    """
    device_type = torch.device(device).type
    if device_type == "cuda":
        return "nccl"
    if device_type == "cpu":
        return "gloo"
    raise ValueError(f"no collective backend configured for device type {device_type!r}")


def is_distributed() -> bool:
    """True when a default process group exists (even one of world size 1)."""
    return torch_dist.is_available() and torch_dist.is_initialized()


def get_rank() -> int:
    """Global rank of this process; 0 without a process group."""
    return torch_dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    """Number of processes in the default group; 1 without a process group."""
    return torch_dist.get_world_size() if is_distributed() else 1


def local_rank() -> int:
    """Rank of this process on its machine: ``LOCAL_RANK`` if set (torchrun, Ray), else the
    global rank modulo the number of visible GPUs (single-node default), else 0."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return get_rank() % torch.cuda.device_count()
    return 0


def current_device() -> torch.device:
    """The concrete device this process computes on: ``cuda:<local_rank>`` or ``cpu``.

    An existing gloo process group pins the answer to CPU even on a GPU machine, because
    gloo collectives on CUDA tensors are not what that group was created for.
    """
    if is_distributed() and torch_dist.get_backend() == "gloo":
        return torch.device("cpu")
    if pick_device() == "cuda":
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


@dataclass(frozen=True)
class DistContext:
    """What :func:`init_distributed` set up (or found already set up)."""

    rank: int
    world_size: int
    device: torch.device
    backend: str


def init_distributed(
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | str | None = None,
    device: str | None = None,
    timeout_s: float = 600.0,
) -> DistContext:
    """Create the default process group, or return the existing one (idempotent).

    Any argument left as ``None`` is read from the usual env vars (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``, as torchrun and Ray set them); defaults are a single
    process on ``127.0.0.1``. The backend always follows the device (:func:`pick_backend`),
    so callers cannot pair NCCL with CPU tensors by mistake.

    Args:
        rank, world_size: this process's global rank and the group size.
        master_addr, master_port: rendezvous address of rank 0.
        device: device type override (``"cpu"`` / ``"cuda"``); default :func:`pick_device`.
            Forcing ``"cpu"`` on a GPU box gives a gloo group (useful for tests).
        timeout_s: collective timeout.

    Returns:
        A :class:`DistContext` describing the group and this process's device.
    """
    device_type = device or pick_device()
    if is_distributed():
        # Idempotent: a second call (e.g. from the engine after the launcher already did it)
        # reports what exists instead of failing or silently creating a second group.
        return DistContext(
            rank=torch_dist.get_rank(),
            world_size=torch_dist.get_world_size(),
            device=current_device(),
            backend=torch_dist.get_backend(),
        )

    rank = int(os.environ.get("RANK", 0)) if rank is None else int(rank)
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else int(world_size)
    master_addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    master_port = master_port or os.environ.get("MASTER_PORT")
    if master_port is None:
        if world_size > 1:
            raise ValueError("init_distributed: master_port (or MASTER_PORT) is required when world_size > 1")
        master_port = find_free_port()

    backend = pick_backend(device_type)
    if device_type == "cuda":
        # NCCL needs the device bound before the first collective; otherwise every rank
        # would talk through cuda:0.
        torch.cuda.set_device(local_rank())
    torch_dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{int(master_port)}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    device_obj = torch.device("cuda", local_rank()) if device_type == "cuda" else torch.device("cpu")
    return DistContext(rank=rank, world_size=world_size, device=device_obj, backend=backend)


def destroy_distributed() -> None:
    """Tear down the default process group if one exists (no-op otherwise)."""
    if is_distributed():
        torch_dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks **in place** and return it; no-op without a group.

    The tensor must live on the group's device (CPU for gloo, CUDA for NCCL).
    """
    if is_distributed() and get_world_size() > 1:
        torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum of ``tensor`` over all ranks **in place**; no-op without a group."""
    if is_distributed() and get_world_size() > 1:
        torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MAX)
    return tensor


def all_gather_objects(obj) -> list:
    """``[obj of rank 0, obj of rank 1, ...]`` (picklable objects); ``[obj]`` without a group."""
    if not (is_distributed() and get_world_size() > 1):
        return [obj]
    out: list = [None] * get_world_size()
    torch_dist.all_gather_object(out, obj)
    return out


def find_free_port() -> int:
    """Return a TCP port that is free on 127.0.0.1 right now (for single-node launches)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
