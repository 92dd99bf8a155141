"""verl's CheckpointEngineManager, unchanged, moving weights from our actor worker group into hf replicas: the
protocol its NCCL engine follows on GPU, run here with the object-store engine (rollout.weight_sync=checkpoint_manager)."""

from __future__ import annotations

import time

import pytest
import torch

from async_rl.rollout.base import GenerationRequest, SamplingParams


pytestmark = pytest.mark.ray


def test_manager_settings_are_checked():
    from async_rl.rollout.settings import ReplicaSettings

    assert ReplicaSettings.from_config({"weight_sync": "checkpoint_manager", "checkpoint_backend": "nccl"})
    with pytest.raises(ValueError, match="rollout.weight_sync='rsync': must be one of pool, checkpoint_manager"):
        ReplicaSettings.from_config({"weight_sync": "rsync"})
    with pytest.raises(ValueError, match="checkpoint_backend=nccl: the pool's own update moves weights through the "
                                         "Ray object store; set rollout.weight_sync=checkpoint_manager"):
        ReplicaSettings.from_config({"checkpoint_backend": "nccl"})
    with pytest.raises(ValueError, match="rollout.mode=hybrid copies the weights in memory"):
        ReplicaSettings.from_config({"mode": "hybrid", "weight_sync": "checkpoint_manager"})


def test_the_object_store_topology_numbers_the_workers_and_names_one_fresh_transfer(ray_cluster):
    from async_rl.rollout.checkpoint_engine import ObjectStoreCheckpointEngine

    actor_kw, rollout_kw = ObjectStoreCheckpointEngine.build_topology(2, 3, [{}] * 5)
    assert actor_kw["rank"] == [0, 1] and rollout_kw["rank"] == [2, 3, 4]
    assert actor_kw["num_senders"] == [2, 2] and rollout_kw["num_senders"] == [2, 2, 2]
    assert len(set(actor_kw["mailbox"] + rollout_kw["mailbox"])) == 1
    assert len(set(actor_kw["transfer"] + rollout_kw["transfer"])) == 1
    again, _ = ObjectStoreCheckpointEngine.build_topology(2, 3, [{}] * 5)
    assert again["mailbox"] == actor_kw["mailbox"] and again["transfer"] != actor_kw["transfer"]


def _request(rid, prompt, max_new_tokens, seed):
    return GenerationRequest(rid, list(prompt), SamplingParams(max_new_tokens=max_new_tokens, seed=seed,
                                                               ignore_eos=True))


def test_verls_manager_moves_sharded_actor_weights_into_replicas_mid_response(ray_cluster, tiny_model):
    """2 FSDP actor ranks, 2 hf replicas, verl's manager with our object-store engine. The actor's weights change;
    one update through the manager reaches both replicas while a response is being generated: the tokens before it
    are version 0, after it version 1, the prefix is kept, and each token's log-prob is exact under the weights of
    its version (teacher forcing, 1e-4); a fresh request equals an in-driver engine holding the new weights."""
    import ray

    from async_rl.models.loading import load_causal_lm
    from async_rl.rollout.launch import launch_replicas
    from async_rl.rollout.pool import ReplicaPool, attach_checkpoint_manager
    from async_rl.rollout.hf_engine import HFRolloutEngine
    from async_rl.workers.placement import make_worker_groups

    groups = make_worker_groups("disaggregated", 2, 0, str(tiny_model), with_critic=False)
    pool = ReplicaPool(launch_replicas("hf", 2, str(tiny_model), chunk_tokens=1), "hf")
    try:
        attach_checkpoint_manager(pool, groups.actor)
        assert pool.takes_version_only
        actor = groups.remote_actor()
        base = actor.export_weights()
        generator = torch.Generator().manual_seed(4)
        new = {k: v + 0.5 * torch.randn(v.shape, generator=generator) for k, v in base.items()}
        actor.load_state_dict({"model": new})  # what a training step does; nothing reached the replicas
        prompt = [1, 2, 3, 4]
        response = 600  # long enough that the update lands mid-response on a loaded machine (1024 positions)
        pool.add_requests([_request("p0/r0/turn0", prompt, response, 5)])
        server = pool.replicas[pool._live["p0/r0/turn0"].replica].servers[0]
        deadline = time.monotonic() + 60
        while len(ray.get(server.progress.remote()).get("p0/r0/turn0", {}).get("token_ids", [])) < 8:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        pool.update_weights(None, 1)  # the manager pulls from the actor ranks: nothing passes the driver
        output = None
        while output is None:
            done = pool.step()
            output = done[0] if done else None
        fresh = [_request("q/r0/turn0", [5, 6, 7], 12, 9), _request("q2/r0/turn0", [7, 1], 12, 3)]
        got = pool.generate(fresh)
    finally:
        pool.shutdown()
        groups.shutdown()
    reference = HFRolloutEngine(str(tiny_model))
    reference.update_weights(new, 1)
    for mine, want in zip(got, reference.generate(fresh)):
        assert mine.token_ids == want.token_ids and mine.versions == [1] * 12
    cut = output.versions.index(1)
    assert 8 <= cut < response and output.versions == [0] * cut + [1] * (response - cut)
    assert pool.counters["weight_updates"] == 1 and pool.policy_version == 1
    model = load_causal_lm(str(tiny_model), device="cpu")
    ids = torch.tensor([prompt + output.token_ids])
    behaviour, versions = torch.tensor(output.logprobs), torch.tensor(output.versions)
    for version, state in ((0, base), (1, new)):
        model.load_state_dict(state)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        recomputed = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt):, None]).squeeze(1)
        mine = versions == version
        assert torch.allclose(behaviour[mine], recomputed[mine], atol=1e-4)
        assert (behaviour[~mine] - recomputed[~mine]).abs().max() > 1e-2


def test_a_replica_killed_before_a_manager_update_is_dropped_and_the_update_reaches_the_other(ray_cluster,
                                                                                             tiny_model):
    import ray

    from async_rl.rollout.launch import launch_replicas
    from async_rl.rollout.pool import ReplicaPool, attach_checkpoint_manager
    from async_rl.workers.placement import make_worker_groups

    groups = make_worker_groups("disaggregated", 1, 0, str(tiny_model), with_critic=False)
    pool = ReplicaPool(launch_replicas("hf", 2, str(tiny_model), chunk_tokens=2), "hf", health_timeout_s=5.0)
    try:
        attach_checkpoint_manager(pool, groups.actor)
        pool.add_requests([_request(f"p{i}/r0/turn0", [1, 2, 3], 300, i) for i in range(4)])  # 2 per replica
        ray.kill(pool.replicas[0].servers[0], no_restart=True)
        started = time.monotonic()
        pool.update_weights(None, 1)
        assert time.monotonic() - started < 60
        outputs = []
        while len(outputs) < 4:
            outputs += pool.step()
    finally:
        pool.shutdown()
        groups.shutdown()
    assert pool.alive == [False, True] and pool.policy_version == 1
    assert "after a failed weight update" in pool.failures[0]["reason"]
    by_reason = sorted(o.finish_reason for o in outputs)
    assert by_reason == ["aborted", "aborted", "length", "length"]
    assert all(1 in o.versions for o in outputs if o.finish_reason == "length")


def test_the_concurrent_driver_trains_with_verls_manager_moving_every_publication(ray_cluster, tiny_model):
    import async_rl.envs.toy  # noqa: F401
    from async_rl.config import AlgorithmConfig
    from async_rl.assemble import RunSpec, build_concurrent_driver
    from async_rl.driver.driver import DriverConfig
    from async_rl.driver.episode import EpisodeLimits
    from async_rl.envs.toy import make_toy_tasks
    from async_rl.rollout.settings import ReplicaSettings

    algo = AlgorithmConfig(name="grpo", train_batch_trajectories=8, group_size=4, actor_lr=1e-3)
    spec = RunSpec(model_path=str(tiny_model), env_name="toy_keys", tasks=make_toy_tasks("toy_keys", 64, 0),
                   max_new_tokens=6, limits=EpisodeLimits(max_turns=2, max_response_tokens=40), workers="ray",
                   rollout=ReplicaSettings(replicas=1, weight_sync="checkpoint_manager"))
    driver = build_concurrent_driver(algo, DriverConfig(total_steps=3, chunk_tokens=4, staleness_cap=1,
                                                        max_inflight_trajectories=16), spec)
    pool = driver.rollout.engine
    try:
        history = driver.run()
    finally:
        driver.learner.actor.worker_groups.shutdown()
    assert pool.checkpoint_manager is not None and pool.takes_version_only
    assert len(history) == 3 and pool.policy_version == driver.learner.policy_version == 3
    assert pool.counters["weight_updates"] == 4  # version 0 at the start, then one per step
    assert all(m["async/policy_lag/max"] <= 1 for m in history)


def test_a_mailbox_slow_to_answer_is_kept_not_created_twice(monkeypatch):
    """Under load the mailbox may miss its 30 s ping; creating a second actor of the same name would fail
    (ActorAlreadyExistsError), so the handle is kept. A mailbox of an earlier Ray session is replaced, and a new one
    is asked for with get_if_exists (never a second actor of one name). No Ray here: its calls are stand-ins."""
    import ray

    from async_rl.rollout import checkpoint_engine as engine

    created = []

    class FakeActorClass:
        def options(self, **options):
            created.append(options)
            return self

        def remote(self):
            return f"mailbox{len(created)}"

    class SlowMailbox:
        class ping:
            @staticmethod
            def remote():
                return "ref"

    def get(ref, timeout=None):
        raise ray.exceptions.GetTimeoutError("busy")

    name = engine._MAILBOX_NAME.format(__import__("os").getpid())
    monkeypatch.setattr(engine.ray, "remote", lambda cls: FakeActorClass())
    monkeypatch.setattr(engine.ray, "get", get)
    monkeypatch.setattr(engine.ObjectStoreCheckpointEngine, "_mailboxes", {name: SlowMailbox()})
    engine.ObjectStoreCheckpointEngine.build_topology(1, 1, [{}] * 2)
    assert created == [] and isinstance(engine.ObjectStoreCheckpointEngine._mailboxes[name], SlowMailbox)

    def gone(ref, timeout=None):
        raise ray.exceptions.RayActorError()

    monkeypatch.setattr(engine.ray, "get", gone)
    engine.ObjectStoreCheckpointEngine.build_topology(1, 1, [{}] * 2)
    assert created == [{"name": name, "num_cpus": 0, "get_if_exists": True}]
    assert engine.ObjectStoreCheckpointEngine._mailboxes[name] == "mailbox1"
