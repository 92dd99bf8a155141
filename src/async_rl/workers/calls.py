"""Bounded calls on verl worker groups: every registered method waits at most ``timeout_s``.

:class:`TimedRayWorkerGroup` (built by :mod:`async_rl.workers.placement`) raises :class:`WorkerCallError`, naming
the method, the worker and the cause, as soon as one worker fails (not after the slowest rank), and
:class:`WorkerTimeoutError` when a call does not finish in time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Optional

import ray
from verl.protocol import DataProto, _padding_size_key
from verl.single_controller.ray import RayWorkerGroup



DEFAULT_CALL_TIMEOUT_S = 600.0


class WorkerCallError(RuntimeError):
    """A worker method raised (or its worker died). ``worker``/``rank`` name the first failure."""

    def __init__(self, message: str, *, method: str, worker: Optional[str], rank: Optional[int],
                 cause: Optional[BaseException] = None):
        super().__init__(message)
        self.method = method
        self.worker = worker
        self.rank = rank
        self.cause = cause


class WorkerTimeoutError(WorkerCallError, TimeoutError):
    """A worker method did not finish within the call's timeout."""


def _original_cause(error: BaseException) -> BaseException:
    """The user exception inside a ``RayTaskError`` (else the error itself)."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


def _other_failures(pending, position, grace_s: float) -> list[int]:
    """Ranks among ``pending`` that fail within a short grace period (the usual case when every rank
    rejects the same bad input); reading them also keeps Ray from logging them as unhandled."""
    if not pending or grace_s <= 0:
        return []
    ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=grace_s)
    failed = []
    for ref in ready:
        try:
            ray.get(ref)
        except Exception:
            failed.append(position[ref])
    return sorted(failed)


def wait_for_workers(refs, *, method: str, worker_names: Sequence[str], timeout_s: float):
    """``ray.get`` with a deadline that fails fast.

    Waits for ``refs`` (one ObjectRef or a list, one per worker) and returns their values. The first
    worker that raises ends the wait at once with a :class:`WorkerCallError`, even while other ranks
    are still running (they may be blocked in a collective waiting for the failed rank). If the
    deadline passes first, :class:`WorkerTimeoutError` names the workers still running.
    """
    single = isinstance(refs, ray.ObjectRef)
    ref_list = [refs] if single else list(refs)
    position = {ref: i for i, ref in enumerate(ref_list)}
    n = len(ref_list)

    def name(i: int) -> str:
        return worker_names[i] if i < len(worker_names) else f"worker {i}"

    deadline = time.monotonic() + timeout_s
    pending = list(ref_list)
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            stuck = [position[r] for r in pending]
            raise WorkerTimeoutError(
                f"{method} did not finish within {timeout_s:g}s on {len(stuck)} of {n} workers: "
                f"{', '.join(f'{name(i)} (rank {i})' for i in stuck)}. The workers keep running; if they are "
                f"blocked (e.g. in a collective after another rank failed), shut the worker group down.",
                method=method, worker=name(stuck[0]), rank=stuck[0])
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as error:  # RayTaskError(cause), ActorDiedError, ...
                i = position[ref]
                cause = _original_cause(error)
                detail = str(cause).strip().splitlines()
                others = _other_failures(pending, position, grace_s=min(0.5, max(deadline - time.monotonic(), 0)))
                also = f" (also failed: {', '.join(f'rank {j}' for j in others)})" if others else ""
                raise WorkerCallError(
                    f"{method} failed on {name(i)} (rank {i} of {n}): {type(cause).__name__}: "
                    f"{detail[-1] if detail else ''}{also}",
                    method=method, worker=name(i), rank=i, cause=cause) from error
    values = ray.get(ref_list)
    return values[0] if single else values


# ============================================================================ worker group with timeouts


def _group_label(worker_group) -> str:
    """``actor`` for a role of a fused (colocated) group, else the worker class name."""
    if getattr(worker_group, "sub_cls_name", ""):
        return worker_group.sub_cls_name
    cls = getattr(getattr(worker_group, "ray_cls_with_init", None), "cls", None)
    name = type(cls).__name__ if cls is not None else type(worker_group).__name__
    if name.startswith("ActorClass(") and name.endswith(")"):
        name = name[len("ActorClass("):-1]
    return name


def _timed_func_generator(worker_group, method_name, dispatch_fn, collect_fn, execute_fn, blocking):
    """Like verl's ``func_generator`` (``verl/single_controller/ray/base.py``), but the wait for the
    workers has a deadline and failures name the worker. ``timeout_s=`` is reserved as a per-call
    keyword (it is not forwarded to the worker)."""

    class Functor:
        def __call__(this, *args, timeout_s: Optional[float] = None, **kwargs):
            try:
                args, kwargs = dispatch_fn(worker_group, *args, **kwargs)
            except Exception as error:
                raise ValueError(
                    f"{_group_label(worker_group)}.{method_name}: cannot dispatch the input over "
                    f"{worker_group.world_size} workers ({type(error).__name__}: {error}); DP methods need a "
                    f"DataProto whose length is a multiple of the world size (see pad_proto_for_dp)") from error
            padding_count = kwargs.pop(_padding_size_key, 0)
            output = execute_fn(method_name, *args, **kwargs)
            if blocking:
                timeout = worker_group.call_timeout_s if timeout_s is None else timeout_s
                label = f"{_group_label(worker_group)}.{method_name}"
                output = wait_for_workers(output, method=label, worker_names=worker_group.worker_names,
                                          timeout_s=timeout)
            output = collect_fn(worker_group, output)
            if padding_count > 0:
                if isinstance(output, DataProto):
                    output = output.select_idxs(list(range(len(output) - padding_count)))
                elif isinstance(output, list):
                    output = output[:-padding_count]
            return output

    return type(method_name, (Functor,), {})()


class TimedRayWorkerGroup(RayWorkerGroup):
    """A verl ``RayWorkerGroup`` whose bound methods never block without a deadline.

    ``call_timeout_s`` is the default per call; ``wg.method(..., timeout_s=30)`` overrides it.
    Everything else (resource pools, dispatch modes, fused/colocated groups, ``spawn``) is verl's.
    """

    def __init__(self, *args, call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S, **kwargs):
        self.call_timeout_s = float(call_timeout_s)
        super().__init__(*args, **kwargs)

    def _bind_worker_method(self, user_defined_cls, func_generator):
        # verl passes its own func_generator (plain ray.get); ours adds the deadline.
        if not hasattr(self, "call_timeout_s"):
            self.call_timeout_s = DEFAULT_CALL_TIMEOUT_S
        return super()._bind_worker_method(user_defined_cls, _timed_func_generator)

    def spawn(self, prefix_set):
        groups = super().spawn(prefix_set)
        for group in groups.values():
            group.call_timeout_s = self.call_timeout_s
        return groups
