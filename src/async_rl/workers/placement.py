"""Worker groups on Ray, in two placements: :func:`make_worker_groups` returns :class:`WorkerGroups`.

``colocated``: one process per train rank holds the actor, the critic and a rollout engine (verl's fused
worker, the "hybrid engine" layout, ``rollout.mode=hybrid``); the engine copies the actor's weights in memory,
and generation and training take turns. ``disaggregated``: the actor and critic share the train processes;
rollout runs elsewhere (the replicas of ``async_rl.rollout.launch.launch_replicas``, or the driver's own engine),
and new weights reach it through the Ray object store. Every role's group is a
:class:`~async_rl.workers.calls.TimedRayWorkerGroup` (every call has a deadline). The resource pool is
checked against ``ray.available_resources()`` first, because verl waits for a placement group without a
timeout.

Details: docs/architecture.md (§2 Placements; "Resources on Ray (CPU now, GPU later)").
"""

from __future__ import annotations

import dataclasses
import math
import os
import uuid
from typing import Any, Optional

import ray
import torch
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, create_colocated_worker_cls_fused

from async_rl.workers.calls import DEFAULT_CALL_TIMEOUT_S, TimedRayWorkerGroup
from async_rl.workers.remote import RemoteActor, RemoteCritic, RemoteSapo
from async_rl.workers.rollout_worker import RolloutWorker
from async_rl.workers.sapo_worker import SapoWorker
from async_rl.workers.train_workers import ActorWorker, CriticWorker

PLACEMENTS = ("colocated", "disaggregated")
# what runs in the "actor" role: the policy alone, or SAPO's single backbone (policy + V + Q, spec §5)
ACTOR_WORKERS = {"actor": ActorWorker, "sapo": SapoWorker}


def ensure_ray(num_cpus: Optional[int] = None, **init_kwargs) -> None:
    """Connect to Ray if this process is not yet: to the cluster ``RAY_ADDRESS`` names when it is set (its
    nodes bring their own CPUs and GPUs, so ``num_cpus`` is not passed: Ray refuses it when joining), else to
    a new local instance with an explicit logical CPU count and no dashboard (``num_cpus`` may exceed the
    physical cores). docs/architecture.md, "Running on a Ray cluster"."""
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if address:
        init_kwargs.pop("include_dashboard", None)
        try:
            ray.init(address=address, **init_kwargs)
        except ConnectionError as error:
            why = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ConnectionError(
                f"could not join the Ray cluster at RAY_ADDRESS={address} ({why}). Is the head up at that address? "
                f"A head started with `ray start --head` uses token authentication (the default of the Ray "
                f"installed here, {ray.__version__}): set RAY_AUTH_MODE=token here and give this machine the cluster's "
                "token (the head's ~/.ray/auth_token, or RAY_AUTH_TOKEN); docs/architecture.md, \"Running on a Ray "
                "cluster\"") from error
        return
    init_kwargs.setdefault("include_dashboard", False)
    ray.init(num_cpus=num_cpus, **init_kwargs)


def _check_resources(n_processes: int, use_gpu: bool, cpus_per_bundle: float) -> None:
    """Fail fast instead of letting verl wait forever for an unsatisfiable placement group."""
    if not ray.is_initialized():
        raise RuntimeError("Ray is not running: call ray.init(num_cpus=..., include_dashboard=False) "
                           "or async_rl.workers.placement.ensure_ray(num_cpus) first")
    available = ray.available_resources()
    need_cpu = n_processes * cpus_per_bundle
    free_cpu, free_gpu = available.get("CPU", 0.0), available.get("GPU", 0.0)
    if free_cpu + 1e-9 < need_cpu:
        raise RuntimeError(
            f"these worker groups need {need_cpu:g} logical CPUs (one bundle per process) but Ray has "
            f"{free_cpu:g} free; start Ray with more, e.g. ray.init(num_cpus={math.ceil(need_cpu) + 2}) "
            f"(logical CPUs are a scheduling label, not cores), or shut down other worker groups")
    if use_gpu and free_gpu + 1e-9 < n_processes:
        raise RuntimeError(f"these worker groups need {n_processes} GPUs but Ray has {free_gpu:g} free")


@dataclasses.dataclass
class WorkerGroups:
    """The role worker groups of one placement, plus what :meth:`shutdown` must release."""

    placement: str
    actor: TimedRayWorkerGroup
    critic: Optional[TimedRayWorkerGroup]
    rollout: Optional[TimedRayWorkerGroup]  # colocated: the fused RolloutWorkers; disaggregated: None
    resource_pools: list[RayResourcePool]
    process_groups: list[TimedRayWorkerGroup]  # the groups that own the Ray actors
    init_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    # the rollout replicas streamed to by the driver (async_rl.rollout.pool.ReplicaPool), stopped with the groups
    rollout_pool: Optional[Any] = None

    def remote_actor(self, timeout_s: Optional[float] = None) -> RemoteActor:
        return RemoteActor(self.actor, timeout_s)

    def remote_sapo(self, timeout_s: Optional[float] = None) -> RemoteSapo:
        """The SAPO adapter of an ``actor_worker="sapo"`` placement (its reserved ids as the workers resolved them)."""
        info = self.init_info.get("actor") or []
        reserved = {tuple(rank["reserved_ids"]) for rank in info if isinstance(rank, dict) and "reserved_ids" in rank}
        if len(reserved) != 1:
            raise RuntimeError("remote_sapo needs worker groups made with actor_worker='sapo' "
                               f"(the actor ranks reported reserved ids {sorted(reserved)})")
        return RemoteSapo(self.actor, reserved.pop(), timeout_s)

    def remote_critic(self, timeout_s: Optional[float] = None) -> Optional[RemoteCritic]:
        return None if self.critic is None else RemoteCritic(self.critic, timeout_s)

    def shutdown(self) -> None:
        """Kill the worker processes (and the rollout replicas) and release their placement groups (idempotent)."""
        if self.rollout_pool is not None:
            self.rollout_pool.shutdown()
            self.rollout_pool = None
        for group in self.process_groups:
            for worker in list(group.workers):
                try:
                    ray.kill(worker, no_restart=True)
                except Exception:  # already dead
                    pass
        for pool in self.resource_pools:
            for pg in pool.pgs or []:
                try:
                    ray.util.remove_placement_group(pg)
                except Exception:
                    pass
            pool.pgs = None
        self.process_groups = []
        self.resource_pools = []


def _pool(n: int, use_gpu: bool, name: str) -> RayResourcePool:
    # max_colocate_count=1: one fused worker process per bundle (it is also 1/num_gpus per process on GPU)
    return RayResourcePool(process_on_nodes=[n], use_gpu=use_gpu, max_colocate_count=1, name_prefix=name)


def _group(pool, class_dict: dict[str, RayClassWithInitArgs], *, name: str, call_timeout_s: float,
           device_name: str, cpus_per_worker: Optional[float], worker_env: dict[str, str]) -> TimedRayWorkerGroup:
    cia = create_colocated_worker_cls_fused(class_dict)
    if cpus_per_worker is not None:
        cia.update_options({"num_cpus": cpus_per_worker})
    # Ray actor names are "{name}FusedWorker_actor_critic_{node}:{local rank}": readable in errors, and
    # unique (the random part) when several placements live in one Ray instance.
    return TimedRayWorkerGroup(resource_pool=pool, ray_cls_with_init=cia, device_name=device_name,
                               name_prefix=name, call_timeout_s=call_timeout_s, worker_env=worker_env)


def make_worker_groups(
    placement: str,
    n_train_workers: int,
    n_rollout_workers: Optional[int],
    model_path: str,
    *,
    actor_kwargs: Optional[dict[str, Any]] = None,
    critic_kwargs: Optional[dict[str, Any]] = None,
    rollout_kwargs: Optional[dict[str, Any]] = None,
    with_critic: bool = True,
    actor_worker: str = "actor",
    use_gpu: Optional[bool] = None,
    cpus_per_worker: Optional[float] = None,
    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    name_prefix: str = "async_rl",
) -> WorkerGroups:
    """Start the worker processes of a placement and initialise their models.

    Args:
        placement: ``"colocated"`` or ``"disaggregated"``.
        n_train_workers: data-parallel ranks of the actor (and critic).
        n_rollout_workers: colocated: ``None`` or ``n_train_workers`` (one fused RolloutWorker per rank);
            disaggregated: ``0`` (train workers only: rollout processes of their own are replicas,
            ``async_rl.rollout.launch.launch_replicas``).
        model_path: local HF checkpoint for every role.
        actor_kwargs / critic_kwargs / rollout_kwargs: extra constructor arguments of
            :class:`ActorWorker` (``optim``, ``temperature``, ``micro_batch_size``, ...),
            :class:`CriticWorker`, :class:`RolloutWorker` (colocated).
        with_critic: build the critic (GRPO-style algorithms do not need one).
        actor_worker: ``"actor"`` (:class:`ActorWorker`) or ``"sapo"`` (:class:`SapoWorker`: SAPO's one
            backbone for policy, V and Q; ``actor_kwargs`` then also take ``reserved``, ``tau_v``, ``r_max``,
            ``kl_coef``; drive it with :meth:`WorkerGroups.remote_sapo`).
        use_gpu: default ``torch.cuda.is_available()`` (on the driver).
        cpus_per_worker: ``num_cpus`` each worker process holds (``None``: Ray's actor default, 0 held
            after scheduling); at most 1, the bundle size.
        call_timeout_s: default deadline of every worker-group call (``init_model`` included).
        name_prefix: prefix of the placement groups and worker names.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if n_train_workers < 1:
        raise ValueError("n_train_workers must be >= 1")
    if actor_worker not in ACTOR_WORKERS:
        raise ValueError(f"actor_worker={actor_worker!r}; valid choices: {', '.join(ACTOR_WORKERS)}")
    if placement == "colocated":
        if n_rollout_workers not in (None, n_train_workers):
            raise ValueError("colocated: every train process holds one rollout engine, so n_rollout_workers "
                             f"must be None or {n_train_workers}, got {n_rollout_workers}")
        n_rollout_workers = n_train_workers
    elif n_rollout_workers != 0:
        raise ValueError(f"disaggregated: n_rollout_workers must be 0, got {n_rollout_workers}: the train groups hold "
                         f"no rollout engine; start rollout processes as replicas (rollout.replicas, "
                         f"async_rl.rollout.launch.launch_replicas)")
    if cpus_per_worker is not None and cpus_per_worker > 1:
        raise ValueError("cpus_per_worker must be <= 1 (the bundle holds one CPU per process)")
    use_gpu = torch.cuda.is_available() if use_gpu is None else bool(use_gpu)
    device_name = "cuda" if use_gpu else "cpu"
    _check_resources(n_train_workers, use_gpu, cpus_per_bundle=1.0)

    model_path = str(model_path)
    roles: dict[str, RayClassWithInitArgs] = {
        "actor": RayClassWithInitArgs(ray.remote(ACTOR_WORKERS[actor_worker]), model_path, **(actor_kwargs or {}))}
    if with_critic:
        roles["critic"] = RayClassWithInitArgs(ray.remote(CriticWorker), model_path, **(critic_kwargs or {}))
    rollout_cia = RayClassWithInitArgs(ray.remote(RolloutWorker), model_path, **(rollout_kwargs or {}))
    common = dict(call_timeout_s=call_timeout_s, device_name=device_name, cpus_per_worker=cpus_per_worker,
                  worker_env={"TOKENIZERS_PARALLELISM": "false"})

    run = f"{name_prefix}_{uuid.uuid4().hex[:6]}"
    pools: list[RayResourcePool] = []
    process_groups: list[TimedRayWorkerGroup] = []
    groups: Optional[WorkerGroups] = None
    try:
        if placement == "colocated":
            pools.append(_pool(n_train_workers, use_gpu, f"{run}_colocated_"))
            fused = _group(pools[0], {**roles, "rollout": rollout_cia}, name=f"{run}_", **common)
            process_groups.append(fused)
            by_role = fused.spawn(prefix_set=list(roles) + ["rollout"])
            rollout = by_role["rollout"]
        else:
            pools.append(_pool(n_train_workers, use_gpu, f"{run}_train_"))
            train = _group(pools[0], roles, name=f"{run}_", **common)
            process_groups.append(train)
            by_role = train.spawn(prefix_set=list(roles))
            rollout = None
        groups = WorkerGroups(placement=placement, actor=by_role["actor"], critic=by_role.get("critic"),
                              rollout=rollout, resource_pools=pools, process_groups=process_groups)
        # order matters when colocated: the rollout engine attaches to the initialised actor
        groups.init_info["actor"] = groups.actor.init_model()
        if groups.critic is not None:
            groups.init_info["critic"] = groups.critic.init_model()
        if groups.rollout is not None:
            groups.init_info["rollout"] = groups.rollout.init_model()
        return groups
    except BaseException:
        if groups is None:
            groups = WorkerGroups(placement, None, None, None, pools, process_groups)  # type: ignore[arg-type]
        groups.shutdown()
        raise


def shutdown_worker_groups(*all_groups: Optional[WorkerGroups]) -> None:
    for groups in all_groups:
        if groups is not None:
            groups.shutdown()


__all__ = ["ACTOR_WORKERS", "PLACEMENTS", "WorkerGroups", "ensure_ray", "make_worker_groups", "shutdown_worker_groups"]
