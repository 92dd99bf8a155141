"""Assemble a run from configs: model, actor, critic, rollout engine, env, prompts, learner and driver.

Kept separate from the loop so tests and benchmarks build the same objects the CLI builds.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from async_rl.config import AlgorithmConfig, plan_for
from async_rl.driver.driver import DeterministicDriver, DriverConfig
from async_rl.driver.episode import ChatFormatter, EpisodeLimits
from async_rl.driver.learner import Learner
from async_rl.driver.prompts import PromptStream
from async_rl.driver.rollout_manager import RolloutManager
from async_rl.engine.base import OptimizerConfig
from async_rl.engine.settings import TrainingSettings
from async_rl.envs.base import make_env
from async_rl.models.loading import load_causal_lm, load_tokenizer
from async_rl.rollout.base import SamplingParams
from async_rl.rollout.settings import ReplicaSettings
from async_rl.rollout.hf_engine import HFRolloutEngine
from async_rl.rollout.publication import choose_publication_form, weights_to_publish
from async_rl.validation import ConfigError
from async_rl.workers.roles import ActorRole, CriticRole


@dataclass
class RunSpec:
    """Everything one run needs besides the algorithm and driver configs."""

    model_path: str  # local HF checkpoint directory (e.g. built by async_rl.models.tiny)
    env_name: str = "toy_keys"  # a registered env (async_rl.envs)
    env_kwargs: dict[str, Any] = field(default_factory=dict)  # constructor arguments of the env
    tasks: list[dict[str, Any]] = field(default_factory=list)  # task records for the prompt stream
    seed: int = 0  # seeds init, data order and sampling
    temperature: float = 1.0  # rollout sampling temperature
    top_p: float = 1.0  # rollout nucleus sampling
    max_new_tokens: int = 48  # per model turn
    stop_strings: tuple[str, ...] = ()  # end a model turn when its text contains one (e.g. "</code>")
    limits: EpisodeLimits = field(default_factory=EpisodeLimits)
    max_grad_norm: float = 1.0  # actor and critic gradient clipping
    micro_batch_size: Optional[int] = None  # actor forward/backward micro-batch (None = whole batch)
    # precision, token budget and activation checkpointing of actor, critic and SAPO (docs/engine.md §7)
    training: TrainingSettings = field(default_factory=TrainingSettings)
    device: str = "cpu"
    workers: str = "local"  # local: actor/critic in this process | ray: verl worker groups on Ray
    train_workers: int = 1  # data-parallel ranks of the actor and critic when workers = ray
    ray_num_cpus: Optional[int] = None  # logical CPUs for a local Ray instance (None: train_workers + replicas + 2)
    # rollout replicas when workers = ray (the in-driver engine serves workers = local); see docs/rollout.md
    rollout: ReplicaSettings = field(default_factory=ReplicaSettings)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_learner_and_rollout(algo: AlgorithmConfig, spec: RunSpec) -> tuple[Learner, RolloutManager]:
    """Actor (+ critic), the rollout engine with the actor's weights at version 0, env and prompt stream."""
    algo.validate()
    spec.training.validate()  # before any model loads
    if spec.workers not in ("local", "ray"):
        raise ValueError(f"workers={spec.workers!r}; valid choices: local, ray")
    seed_everything(spec.seed)
    tokenizer = load_tokenizer(spec.model_path)
    critic = None
    actor_optim = OptimizerConfig(lr=algo.actor_lr, max_grad_norm=spec.max_grad_norm, weight_decay=0.0)
    banned: tuple[int, ...] = ()
    shared_backbone = plan_for(algo.name).shared_backbone  # SAPO: policy, V and Q in one model
    if shared_backbone and spec.workers == "ray":
        # the same backbone as SapoWorker ranks (FSDP); their reserved ids are banned on the rollout replicas
        actor, _ = _ray_trainers(algo, spec, actor_optim)
        banned = tuple(actor.banned_token_ids)
    elif shared_backbone:
        # one backbone for policy, V and Q; the two reserved ids are never sampled (spec §5)
        from async_rl.workers.sapo import SapoRole, resolve_reserved_ids

        reserved = resolve_reserved_ids(tokenizer, list(algo.sapo_reserved_tokens))
        actor = SapoRole(load_causal_lm(spec.model_path, device=spec.device, **spec.training.model_kwargs()), actor_optim, reserved_ids=reserved,
                         tau_v=algo.sapo_tau_v, r_max=algo.sapo_r_max, temperature=spec.temperature,
                         micro_batch_size=spec.micro_batch_size, kl_coef=algo.sapo_kl_coef,
                         **spec.training.role_kwargs())
        banned = tuple(actor.banned_token_ids)
    elif spec.workers == "ray":
        actor, critic = _ray_trainers(algo, spec, actor_optim)
    else:
        actor = ActorRole(load_causal_lm(spec.model_path, device=spec.device, **spec.training.model_kwargs()), actor_optim,
                          temperature=spec.temperature, micro_batch_size=spec.micro_batch_size,
                          **spec.training.role_kwargs())
    if spec.workers == "local" and algo.use_critic:
        critic = CriticRole(load_causal_lm(spec.model_path, device=spec.device, **spec.training.model_kwargs()),
                            OptimizerConfig(lr=algo.critic_lr, max_grad_norm=spec.max_grad_norm, weight_decay=0.0),
                            freeze_attention=algo.freeze_critic_attention, **spec.training.role_kwargs())
    if spec.workers == "ray":
        # rollout replicas in their own processes, streamed to by the driver (async_rl.rollout.pool)
        engine = _rollout_replicas(spec, actor)
    else:
        # the rollout engine gets its own copy of the weights (a disaggregated placement in one process)
        engine = HFRolloutEngine(load_causal_lm(spec.model_path, device=spec.device), tokenizer, device=spec.device)
        engine.update_weights(actor.export_weights(), 0)
    if engine.max_positions is not None and spec.limits.max_context_tokens is None:
        spec.limits = dataclasses.replace(spec.limits, max_context_tokens=int(engine.max_positions))
    if spec.limits.overlong_penalty is None:  # the algorithm's setting is the default (AlgorithmConfig)
        spec.limits = dataclasses.replace(spec.limits, overlong_penalty=algo.overlong_penalty)
    formatter = ChatFormatter(tokenizer)
    if spec.limits.max_turns > 1:  # a template that cannot frame observations stops the run here, in one line
        try:
            formatter.frame  # noqa: B018
        except ValueError as exc:
            raise ConfigError(f"model {spec.model_path}: {exc}") from None
    end_id = formatter.end_token_id
    sampling = SamplingParams(temperature=spec.temperature, top_p=spec.top_p, max_new_tokens=spec.max_new_tokens,
                              stop_token_ids=(end_id,) if end_id is not None else (), banned_token_ids=banned,
                              stop_strings=tuple(spec.stop_strings))
    if not spec.tasks:
        raise ValueError("RunSpec.tasks is empty: give the prompt stream some task records")
    rollout = RolloutManager(engine, lambda: make_env(spec.env_name, **spec.env_kwargs), formatter, sampling, spec.limits,
                             PromptStream(spec.tasks, spec.seed), spec.seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    learner = Learner(algo, actor, critic, pad_token_id=pad)
    return learner, rollout


def _ray_trainers(algo: AlgorithmConfig, spec: RunSpec, actor_optim: OptimizerConfig):
    """Actor (and critic) as verl worker groups on Ray (the rollout replicas are started by _rollout_replicas).

    Returns driver-side adapters with the same methods as :class:`ActorRole` / :class:`CriticRole`; for
    ``algorithm=sapo`` a :class:`~async_rl.workers.remote.RemoteSapo` (the methods of
    :class:`~async_rl.workers.sapo.SapoRole`) over SapoWorker ranks, and no critic (V and Q are read from the
    policy's own backbone, spec §5).
    """
    from async_rl.workers.placement import ensure_ray, make_worker_groups

    spec.rollout.validate()  # before any worker starts
    spec.rollout.check_placement(spec.train_workers)
    hybrid = spec.rollout.mode == "hybrid"
    ensure_ray(num_cpus=spec.ray_num_cpus or spec.train_workers + _replica_cpus(spec) + 2, log_to_driver=False)
    critic_optim = OptimizerConfig(lr=algo.critic_lr, max_grad_norm=spec.max_grad_norm, weight_decay=0.0)
    sapo = plan_for(algo.name).shared_backbone
    actor_kwargs = {"optim": actor_optim, "temperature": spec.temperature, "micro_batch_size": spec.micro_batch_size,
                    "training": spec.training}
    if sapo:  # every rank resolves the same reserved ids from the checkpoint's tokenizer (SapoWorker.init_model)
        actor_kwargs.update(reserved=list(algo.sapo_reserved_tokens), tau_v=algo.sapo_tau_v, r_max=algo.sapo_r_max,
                            kl_coef=algo.sapo_kl_coef)
    # hybrid: a RolloutWorker fused into every train rank (the "colocated" placement) serves that rank's replica;
    # standalone: train ranks only, the replicas get their own processes in _rollout_replicas
    groups = make_worker_groups(
        "colocated" if hybrid else "disaggregated", spec.train_workers, None if hybrid else 0, spec.model_path,
        actor_kwargs=actor_kwargs,
        # a vLLM hybrid replica is built with the run's vLLM settings
        rollout_kwargs={"torch_threads": torch.get_num_threads() if spec.device == "cpu" else None,
                        "engine": spec.rollout.engine,
                        "engine_options": spec.rollout.vllm_engine_options() if spec.rollout.engine == "vllm" else None},
        critic_kwargs={"optim": critic_optim, "freeze_attention": algo.freeze_critic_attention,
                       "training": spec.training},
        with_critic=algo.use_critic and not sapo, actor_worker="sapo" if sapo else "actor",
        use_gpu=spec.device == "cuda",  # trainer.device=cpu keeps GPUs for rollout
    )
    try:
        actor = groups.remote_sapo() if sapo else groups.remote_actor()
    except BaseException:
        groups.shutdown()
        raise
    actor.worker_groups = groups  # kept alive with the actor; shut down by the caller (see train.py)
    return actor, groups.remote_critic()


def _replica_cpus(spec: RunSpec) -> int:
    import math

    if spec.rollout.mode == "hybrid":
        return 0  # the replicas run inside the train ranks
    return math.ceil(float(spec.rollout.cpus_per_replica) * int(spec.rollout.replicas))


def _tokenizer(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _rollout_replicas(spec: RunSpec, actor):
    """``spec.rollout.replicas`` replicas of ``spec.rollout.engine`` (verl's registry) behind a ReplicaPool, given the
    actor's current weights as version 0. The pool is shut down with the actor's worker groups."""
    import os

    from transformers import AutoConfig

    from async_rl.rollout.launch import launch_replicas
    from async_rl.rollout.pool import ReplicaPool, attach_checkpoint_manager

    model_config = AutoConfig.from_pretrained(spec.model_path)
    settings = spec.rollout
    settings.validate()
    groups = getattr(actor, "worker_groups", None)
    hybrid = settings.mode == "hybrid"
    replicas = launch_replicas(settings.engine, int(settings.replicas), spec.model_path,
                               device=settings.device or spec.device,
                               torch_threads=torch.get_num_threads() if spec.device == "cpu" else None,
                               chunk_tokens=int(settings.chunk_tokens), num_cpus=float(settings.cpus_per_replica),
                               mode=settings.mode, worker_group=groups.process_groups[0] if hybrid else None,
                               checkpoint_backend=settings.checkpoint_backend,
                               kv_on_update=settings.vllm_kv_on_update, engine_options=settings.vllm_engine_options(),
                               replica_resources=settings.replica_resources)
    pool = ReplicaPool(replicas, settings.engine, on_replica_failure=settings.on_replica_failure,
                       health_timeout_s=float(settings.health_timeout_s),
                       vocab_size=getattr(model_config, "vocab_size", None), tokenizer=_tokenizer(spec.model_path))
    if groups is not None:
        groups.rollout_pool = pool  # WorkerGroups.shutdown() stops the replicas too
    if settings.weight_sync == "checkpoint_manager":  # verl's CheckpointEngineManager moves every publication
        attach_checkpoint_manager(pool, groups.actor, backend=settings.checkpoint_backend)
    pool.max_positions = getattr(model_config, "max_position_embeddings", None)
    if settings.engine in ("hf", "vllm") or pool.checkpoint_manager is not None:
        # the replicas start from the actor's weights (vLLM/SGLang through the pool load the same checkpoint)
        pool.update_weights(weights_to_publish(choose_publication_form(actor, pool), actor, 0), 0)
    where = "inside the train ranks" if hybrid else "in their own processes"
    print(f"rollout: {len(replicas)} {settings.engine} replica(s) {where} ({settings.mode}), pids {pool.pids} "
          f"(driver pid {os.getpid()})", flush=True)
    return pool


def build_deterministic_driver(algo: AlgorithmConfig, driver_cfg: DriverConfig, spec: RunSpec, on_step=None,
                               checkpoint_dir=None) -> DeterministicDriver:
    learner, rollout = build_learner_and_rollout(algo, spec)
    return DeterministicDriver(driver_cfg, learner, rollout, on_step=on_step, checkpoint_dir=checkpoint_dir)


def build_concurrent_driver(algo: AlgorithmConfig, driver_cfg: DriverConfig, spec: RunSpec, on_step=None,
                            checkpoint_dir=None):
    from async_rl.driver.concurrent import ConcurrentDriver

    learner, rollout = build_learner_and_rollout(algo, spec)
    return ConcurrentDriver(driver_cfg, learner, rollout, on_step=on_step, checkpoint_dir=checkpoint_dir)
