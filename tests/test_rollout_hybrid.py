"""rollout.mode=hybrid: the hf engine fused into the train ranks (verl's RolloutReplica.init_hybrid), served by an
HybridServer, driven by the same ReplicaPool and schedulers as standalone replicas."""

from __future__ import annotations

import os
import time

import pytest
import torch

from async_rl.rollout.base import GenerationRequest, SamplingParams


pytestmark = pytest.mark.ray


# ---------------------------------------------------------------------------------------------- no Ray needed
def test_hybrid_settings_are_checked_before_anything_starts():
    from async_rl.rollout.settings import ReplicaSettings

    assert ReplicaSettings.from_config({"mode": "hybrid"}).mode == "hybrid"  # hf: supported (vllm: test_vllm_hybrid)
    with pytest.raises(ValueError, match="rollout.mode=hybrid runs the hf or vllm engine inside the train workers; "
                                         "verl's sglang hybrid engine needs verl's own ActorRolloutRefWorker"):
        ReplicaSettings.from_config({"mode": "hybrid", "engine": "sglang"})
    with pytest.raises(ValueError, match=r"rollout.replicas=2 but trainer.train_workers=1; set them equal"):
        ReplicaSettings(mode="hybrid", replicas=2).check_placement(1)
    ReplicaSettings(mode="standalone", replicas=2).check_placement(1)  # standalone: any number
    ReplicaSettings(mode="hybrid", replicas=2).check_placement(2)


def test_release_cache_keeps_every_token_and_the_continuation_is_exact(tmp_path):
    """Freeing the KV cache mid-response (the hybrid sleep) changes nothing in what is sampled: the rows are
    re-prefilled from prompt + tokens so far and continue on their own random streams."""
    from async_rl.models.tiny import make_tiny_model
    from async_rl.rollout.hf_engine import HFRolloutEngine

    model = make_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1)
    requests = [GenerationRequest(f"r{i}", [1, 2, 3 + i], SamplingParams(max_new_tokens=24, seed=i, ignore_eos=True))
                for i in range(3)]
    expected = HFRolloutEngine(str(model)).generate(requests)
    engine = HFRolloutEngine(str(model))
    engine.start(requests)
    outputs = engine.step(7)
    engine.release_cache()
    assert engine._batch.cache is None and engine.num_unfinished == 3
    while engine.has_unfinished:
        outputs += engine.step(5)
        engine.release_cache()
    got = {o.request_id: o for o in outputs}
    for want in expected:
        assert got[want.request_id].token_ids == want.token_ids
        assert torch.allclose(torch.tensor(got[want.request_id].logprobs), torch.tensor(want.logprobs), atol=1e-5)


# ---------------------------------------------------------------------------------------------- on Ray
def _hybrid(model, train_workers=1, chunk_tokens=2, **pool_kwargs):
    """Colocated train ranks (actor + rollout engine with its own weight copy) and one hybrid replica per rank."""
    from async_rl.rollout.launch import launch_replicas
    from async_rl.rollout.pool import ReplicaPool
    from async_rl.workers.placement import make_worker_groups

    groups = make_worker_groups("colocated", train_workers, None, str(model), with_critic=False)
    try:
        replicas = launch_replicas("hf", train_workers, str(model), mode="hybrid",
                                   worker_group=groups.process_groups[0], chunk_tokens=chunk_tokens)
        groups.rollout_pool = ReplicaPool(replicas, "hf", **pool_kwargs)
    except BaseException:
        groups.shutdown()
        raise
    return groups, groups.rollout_pool


def _request(rid, prompt, max_new_tokens=10, seed=0):
    return GenerationRequest(rid, list(prompt), SamplingParams(max_new_tokens=max_new_tokens, seed=seed,
                                                               ignore_eos=True))


def _wait(predicate, timeout_s=60.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.005)
    raise AssertionError(f"{what} not reached within {timeout_s} s")


def test_a_hybrid_replica_generates_inside_its_train_rank_exactly_as_the_in_driver_engine(ray_cluster, tiny_model):
    from async_rl.rollout.hf_engine import HFRolloutEngine

    groups, pool = _hybrid(tiny_model)
    try:
        train_pid = groups.actor.ping()[0]["pid"]
        assert pool.pids == [train_pid] and train_pid != os.getpid()  # the engine runs in the train process
        assert pool.weights_in_process
        requests = [_request(f"p{i}/r0/turn0", [1, 2, 3, 4 + i], max_new_tokens=8 + i, seed=i) for i in range(4)]
        outputs = pool.generate(requests)
    finally:
        groups.shutdown()
    for got, want in zip(outputs, HFRolloutEngine(str(tiny_model)).generate(requests)):
        assert got.token_ids == want.token_ids and got.versions == [0] * len(want.token_ids)
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5)


def test_tokens_between_an_update_and_its_publication_keep_the_old_version_and_exact_logprobs(ray_cluster,
                                                                                               tiny_model):
    """One response on a hybrid replica while the actor's weights change in the same process.

    The actor loads new weights (a training step's effect) mid-response: the rollout's own copy keeps version 0,
    so the tokens sampled before the publication are version 0 and exact under the old weights; after
    ``update_weights(..., 1)`` (only the version travels) the prefix is kept byte for byte and every later token is
    version 1 with its log-prob exact under the new weights. Each check fails under the other version's weights."""
    import ray

    from async_rl.models.loading import load_causal_lm

    groups, pool = _hybrid(tiny_model, chunk_tokens=1)
    server = pool.replicas[0].servers[0]
    actor = groups.remote_actor()
    base = actor.export_weights()
    generator = torch.Generator().manual_seed(3)
    new = {k: v + 0.5 * torch.randn(v.shape, generator=generator) for k, v in base.items()}
    prompt = [1, 2, 3, 4, 5]
    response = 600  # long enough that a stalled test process still pauses it mid-response (1024 positions)
    try:
        pool.add_requests([_request("p0/r0/turn0", prompt, max_new_tokens=response, seed=5)])
        _wait(lambda: len(ray.get(server.progress.remote()).get("p0/r0/turn0", {}).get("token_ids", [])) >= 8,
              what="8 tokens before the update")
        actor.load_state_dict({"model": new})  # the trainer's weights change; nothing is published yet
        before = len(ray.get(server.progress.remote())["p0/r0/turn0"]["token_ids"])
        _wait(lambda: len(ray.get(server.progress.remote())["p0/r0/turn0"]["token_ids"]) >= before + 4,
              what="decoding under the old copy after the actor changed")
        ray.get(server.abort_all_requests.remote())  # pause to read the exact prefix that resumes
        prefix = ray.get(server.progress.remote())["p0/r0/turn0"]["token_ids"]
        with pytest.raises(ValueError, match="this pool takes only the version"):
            pool.update_weights(new, 1)  # a state dict would be ignored: refused, naming the strategy
        pool.update_weights(None, 1)  # hybrid: only the version travels; the replica copies the actor's weights in
        output = _wait(lambda: (pool.step() or [None])[0], timeout_s=120, what="the response")
    finally:
        groups.shutdown()
    cut = len(prefix)
    assert 12 <= cut < response and output.token_ids[:cut] == prefix and len(output.token_ids) == response
    assert output.versions == [0] * cut + [1] * (response - cut)
    model = load_causal_lm(str(tiny_model), device="cpu")
    ids = torch.tensor([prompt + output.token_ids])
    behaviour, versions = torch.tensor(output.logprobs), torch.tensor(output.versions)
    recomputed = {}
    for version, state in ((0, base), (1, new)):
        model.load_state_dict(state)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        recomputed[version] = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt):, None]).squeeze(1)
    for version, other in ((0, 1), (1, 0)):
        mine = versions == version
        assert torch.allclose(behaviour[mine], recomputed[version][mine], atol=1e-4)
        assert (behaviour[mine] - recomputed[other][mine]).abs().max() > 1e-2


def test_sleep_parks_a_hybrid_replica_with_its_tokens_and_wake_up_continues(ray_cluster, tiny_model):
    import ray

    groups, pool = _hybrid(tiny_model, chunk_tokens=1)
    server = pool.replicas[0].servers[0]
    try:
        pool.add_requests([_request("p0/r0/turn0", [1, 2, 3], max_new_tokens=300, seed=1)])
        _wait(lambda: len(ray.get(server.progress.remote()).get("p0/r0/turn0", {}).get("token_ids", [])) >= 4,
              what="4 tokens")
        ray.get(server.sleep.remote())
        asleep = ray.get(server.progress.remote())["p0/r0/turn0"]["token_ids"]
        time.sleep(0.3)
        assert ray.get(server.progress.remote())["p0/r0/turn0"]["token_ids"] == asleep  # nothing decoded
        assert ray.get(server.ping.remote())["asleep"] is True
        pool.add_requests([_request("p1/r0/turn0", [4, 5], max_new_tokens=3, seed=2)])  # held while asleep
        time.sleep(0.2)
        assert pool.step() == []
        ray.get(server.wake_up.remote())
        outputs = []
        _wait(lambda: outputs.extend(pool.step()) or len(outputs) == 2, timeout_s=120, what="both responses")
    finally:
        groups.shutdown()
    by_id = {o.request_id: o for o in outputs}
    assert by_id["p0/r0/turn0"].token_ids[:len(asleep)] == asleep and len(by_id["p0/r0/turn0"].token_ids) == 300
    assert len(by_id["p1/r0/turn0"].token_ids) == 3


def test_a_hybrid_replica_needs_a_rollout_engine_in_the_train_rank(ray_cluster, tiny_model):
    from async_rl.rollout.launch import launch_replicas
    from async_rl.workers.placement import make_worker_groups

    train_only = make_worker_groups("disaggregated", 1, 0, str(tiny_model), with_critic=False)
    try:
        with pytest.raises(RuntimeError, match=r"train rank 0 has no rollout engine to serve .*colocated"):
            launch_replicas("hf", 1, str(tiny_model), mode="hybrid", worker_group=train_only.process_groups[0])
    finally:
        train_only.shutdown()
    with pytest.raises(ValueError, match=r"disaggregated: n_rollout_workers must be 0.*replicas"):
        make_worker_groups("disaggregated", 1, 1, str(tiny_model), with_critic=False)
    shared = make_worker_groups("colocated", 1, None, str(tiny_model), with_critic=False)
    try:
        with pytest.raises(ValueError, match=r"rollout.replicas=2 but trainer.train_workers=1"):
            launch_replicas("hf", 2, str(tiny_model), mode="hybrid", worker_group=shared.process_groups[0])
    finally:
        shared.shutdown()


def test_a_dead_train_rank_fails_its_hybrid_replica_without_a_hang(ray_cluster, tiny_model):
    import ray

    from async_rl.rollout.pool import ReplicaFailure

    groups, pool = _hybrid(tiny_model, health_check_s=0.2, health_timeout_s=5.0)
    try:
        # 1000 tokens each, and the kill right after the submission: still running when their rank dies
        pool.add_requests([_request(f"p{i}/r0/turn0", [1, 2, 3], max_new_tokens=1000, seed=i) for i in range(3)])
        ray.kill(groups.process_groups[0].workers[0], no_restart=True)
        started = time.monotonic()
        with pytest.raises(ReplicaFailure, match=r"rollout replica 0 \(pid \d+\) failed: .*train worker failed"):
            _wait(lambda: pool.step() and False, timeout_s=30, what="the failure")
        assert time.monotonic() - started < 30
    finally:
        groups.shutdown()
    assert pool.alive == [False] and pool.counters["replica_aborted"] == 3


@pytest.mark.parametrize("scheduler", ["concurrent", "deterministic"])
def test_both_schedulers_train_on_hybrid_replicas_inside_the_train_rank(ray_cluster, tiny_model, scheduler):
    """GRPO on a Ray actor group with the rollout fused into it: every step publishes only a version, the
    replica's engine runs in the train process, and the trained lag stays within the cap."""
    import async_rl.envs.toy  # noqa: F401
    from async_rl.config import AlgorithmConfig
    from async_rl.assemble import RunSpec, build_concurrent_driver, build_deterministic_driver
    from async_rl.driver.driver import DriverConfig
    from async_rl.driver.episode import EpisodeLimits
    from async_rl.envs.toy import make_toy_tasks
    from async_rl.rollout.settings import ReplicaSettings

    algo = AlgorithmConfig(name="grpo", train_batch_trajectories=8, group_size=4, actor_lr=1e-3)
    spec = RunSpec(model_path=str(tiny_model), env_name="toy_keys", tasks=make_toy_tasks("toy_keys", 64, 0),
                   max_new_tokens=6, limits=EpisodeLimits(max_turns=2, max_response_tokens=40), workers="ray",
                   rollout=ReplicaSettings(mode="hybrid"))
    build = build_concurrent_driver if scheduler == "concurrent" else build_deterministic_driver
    cfg = DriverConfig(total_steps=3, chunk_tokens=4, staleness_cap=1, max_inflight_trajectories=16,
                       synchronous=scheduler == "deterministic")
    driver = build(algo, cfg, spec)
    pool = driver.rollout.engine
    try:
        train_pid = driver.learner.actor.worker_groups.actor.ping()[0]["pid"]
        history = driver.run()
    finally:
        driver.learner.actor.worker_groups.shutdown()
    assert pool.weights_in_process and pool.pids == [train_pid]
    assert len(history) == 3 and pool.policy_version == driver.learner.policy_version == 3
    assert pool.counters["weight_updates"] == 4  # version 0 at start, then one per step
    assert all(m["async/policy_lag/max"] <= 1 for m in history)
    if scheduler == "deterministic":  # synchronous: each batch is generated by the version it trains
        assert all(m["async/policy_lag/max"] == 0 for m in history)
