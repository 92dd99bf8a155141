"""HFRolloutEngine: behaviour log-probs, stopping, banned ids, in-flight weight updates."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from async_rl.models.tiny import IM_END_TOKEN, make_tiny_model
from async_rl.rollout import GenerationRequest, HFRolloutEngine, SamplingParams

ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def single_intra_op_thread():
    # The tiny model's ops are far too small to split across threads; on a shared 2-core
    # box OpenMP contention made these tests ~10x slower. Restored after this module.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("rollout") / "tiny", seed=0)


@pytest.fixture
def engine(tiny_dir):
    # A fresh engine per test: in-flight update tests change the weights.
    return HFRolloutEngine(tiny_dir, device="cpu")


PROMPTS = [
    "hi",
    "The answer is \\boxed{",
    "<think> search the room, then click[door] and look north </think> action:",
]


def encode_prompts(engine, prompts=PROMPTS):
    return [engine.tokenizer.encode(p, add_special_tokens=False) for p in prompts]


def make_requests(engine, sampling: SamplingParams, prompts=PROMPTS, seed0=0):
    return [
        GenerationRequest(f"r{i}", ids, SamplingParams(**{**sampling.__dict__, "seed": seed0 + i}))
        for i, ids in enumerate(encode_prompts(engine, prompts))
    ]


def teacher_forced_logprobs(model, output, temperature, banned_ids=()):
    """log_softmax(logits / T) over non-banned ids at each generated token: [num_tokens]."""
    ids = torch.tensor([output.prompt_ids + output.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    if banned_ids:
        logits[:, list(banned_ids)] = float("-inf")
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    num_prompt = len(output.prompt_ids)
    positions = logprobs[num_prompt - 1 : -1]  # logits at t predict token t + 1
    return positions.gather(1, torch.tensor(output.token_ids)[:, None]).squeeze(1)


def perturbed_state_dict(model, scale=0.05, seed=123):
    generator = torch.Generator().manual_seed(seed)
    return {
        name: tensor + scale * torch.randn(tensor.shape, generator=generator)
        for name, tensor in model.state_dict().items()
    }


def test_logprobs_match_teacher_forcing_for_mixed_length_batch(engine):
    prompt_lengths = {len(ids) for ids in encode_prompts(engine)}
    assert len(prompt_lengths) == 3  # really a left-padded batch
    # top_p < 1 on purpose: the recorded log-prob is the untruncated tempered one.
    requests = make_requests(engine, SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=24, ignore_eos=True))
    outputs = engine.generate(requests)
    for output in outputs:
        assert len(output.token_ids) == len(output.logprobs) == len(output.versions) == 24
        reference = teacher_forced_logprobs(engine.model, output, temperature=0.7)
        torch.testing.assert_close(torch.tensor(output.logprobs), reference, atol=ATOL, rtol=0)
        assert output.versions == [0] * 24


def test_greedy_and_tiny_top_p_pick_argmax_with_temperature_one_logprobs(engine):
    greedy = engine.generate(make_requests(engine, SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)))
    nucleus = engine.generate(
        make_requests(engine, SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=10, ignore_eos=True), seed0=50)
    )
    for g, n in zip(greedy, nucleus):
        assert g.token_ids == n.token_ids  # a nucleus of one token is the argmax
        ids = torch.tensor([g.prompt_ids + g.token_ids])
        with torch.no_grad():
            logits = engine.model(ids).logits[0]
        assert g.token_ids == logits[len(g.prompt_ids) - 1 : -1].argmax(-1).tolist()
        reference = teacher_forced_logprobs(engine.model, g, temperature=1.0)
        torch.testing.assert_close(torch.tensor(g.logprobs), reference, atol=ATOL, rtol=0)
        torch.testing.assert_close(torch.tensor(n.logprobs), reference, atol=ATOL, rtol=0)


def test_max_new_tokens(engine):
    outputs = engine.generate(
        [
            GenerationRequest("short", [5, 6, 7], SamplingParams(max_new_tokens=1, seed=0, ignore_eos=True)),
            GenerationRequest("long", [5], SamplingParams(max_new_tokens=7, seed=1, ignore_eos=True)),
        ]
    )
    assert [(o.request_id, o.num_tokens, o.finish_reason) for o in outputs] == [
        ("short", 1, "length"),
        ("long", 7, "length"),
    ]
    # A context that reaches max_position_embeddings (1024 here) ends with "length" too.
    near_limit = [5] * (engine.max_positions - 3)
    edge_request = GenerationRequest("edge", near_limit, SamplingParams(max_new_tokens=50, seed=0, ignore_eos=True))
    output = engine.generate([edge_request])[0]
    assert (output.num_tokens, output.finish_reason) == (3, "length")


def letter_ids(tokenizer, letters):
    ids = [tokenizer.convert_tokens_to_ids(letter) for letter in letters]
    assert all(isinstance(i, int) and tokenizer.decode([i]) == letter for i, letter in zip(ids, letters))
    return ids


def all_ids_except(engine, allowed):
    return tuple(i for i in range(engine.vocab_size) if i not in set(allowed))


def test_stop_string_stops_at_first_occurrence(engine):
    allowed = letter_ids(engine.tokenizer, "abc")  # every token is exactly one character
    base = SamplingParams(max_new_tokens=40, banned_token_ids=all_ids_except(engine, allowed), seed=7, ignore_eos=True)
    free = engine.generate([GenerationRequest("x", [10, 11], base)])[0]
    stop = free.text[12:15]
    first_end = free.text.find(stop) + len(stop)
    stopped = engine.generate(
        [GenerationRequest("x", [10, 11], SamplingParams(**{**base.__dict__, "stop_strings": ("zzz", stop)}))]
    )[0]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop)
    assert stopped.token_ids == free.token_ids[:first_end]
    assert stopped.text == free.text[:first_end] and stopped.text.endswith(stop)
    assert stopped.logprobs == free.logprobs[:first_end]


def test_eos_and_stop_token_ids(engine):
    tokenizer = engine.tokenizer
    eos, im_end = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END_TOKEN)
    assert engine.eos_token_ids == {eos, im_end}  # tokenizer eos + generation_config eos list
    a, b = letter_ids(tokenizer, "ab")
    banned = all_ids_except(engine, [a, b, eos])
    requests = [
        GenerationRequest(f"s{seed}", [10], SamplingParams(max_new_tokens=200, banned_token_ids=banned, seed=seed))
        for seed in range(4)
    ]
    for output in engine.generate(requests):
        assert (output.finish_reason, output.stop_reason) == ("stop", eos)
        assert output.token_ids[-1] == eos and eos not in output.token_ids[:-1]
        assert "<|endoftext|>" not in output.text  # special tokens are skipped in text

    # ignore_eos: eos is sampled but does not stop; a custom stop token does.
    ignoring_eos = SamplingParams(max_new_tokens=20, banned_token_ids=banned, seed=0, ignore_eos=True)
    ignoring = engine.generate([GenerationRequest("i", [10], ignoring_eos)])[0]
    assert ignoring.finish_reason == "length" and eos in ignoring.token_ids
    stop_on_b = SamplingParams(**{**ignoring_eos.__dict__, "stop_token_ids": (b,)})
    custom = engine.generate([GenerationRequest("c", [10], stop_on_b)])[0]
    assert (custom.finish_reason, custom.stop_reason, custom.token_ids[-1]) == ("stop", b, b)
    assert b not in custom.token_ids[:-1]


def test_banned_ids_never_sampled_and_logprobs_renormalised(engine):
    generator = torch.Generator().manual_seed(0)
    allowed = torch.randperm(engine.vocab_size, generator=generator)[:12].tolist()
    banned = all_ids_except(engine, allowed)
    sampling = SamplingParams(temperature=1.5, max_new_tokens=40, banned_token_ids=banned, ignore_eos=True)
    outputs = engine.generate(make_requests(engine, sampling))
    for output in outputs:
        assert set(output.token_ids) <= set(allowed)
        reference = teacher_forced_logprobs(engine.model, output, temperature=1.5, banned_ids=banned)
        torch.testing.assert_close(torch.tensor(output.logprobs), reference, atol=ATOL, rtol=0)
        # Normalising over the full vocabulary would give much smaller log-probs.
        unrestricted = teacher_forced_logprobs(engine.model, output, temperature=1.5)
        assert (reference - unrestricted).min() > 1.0


def test_same_seed_twice_is_identical_and_seed_matters(engine):
    sampling = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=16, ignore_eos=True)
    first = engine.generate(make_requests(engine, sampling))
    second = engine.generate(make_requests(engine, sampling))
    other = engine.generate(make_requests(engine, sampling, seed0=100))
    assert [(o.token_ids, o.logprobs, o.text) for o in first] == [(o.token_ids, o.logprobs, o.text) for o in second]
    assert [o.token_ids for o in first] != [o.token_ids for o in other]


def test_inflight_update_between_chunks(tiny_dir, engine):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=14, ignore_eos=True)
    chunk = 5
    old_model = HFRolloutEngine(tiny_dir).model  # untouched copy of the version-0 weights
    no_update = engine.generate(make_requests(engine, sampling))

    engine.start(make_requests(engine, sampling))
    assert engine.step(chunk) == []
    new_weights = perturbed_state_dict(engine.model)
    engine.update_weights(new_weights, version=1)
    assert engine.policy_version == 1
    outputs = sorted(engine.step(), key=lambda o: o.request_id)
    assert not engine.has_unfinished

    for before, after in zip(no_update, outputs):
        assert after.versions == [0] * chunk + [1] * (14 - chunk)
        assert after.token_ids[:chunk] == before.token_ids[:chunk]
        assert after.logprobs[:chunk] == before.logprobs[:chunk]
        old_reference = teacher_forced_logprobs(old_model, after, temperature=1.0)
        new_reference = teacher_forced_logprobs(engine.model, after, temperature=1.0)
        logprobs = torch.tensor(after.logprobs)
        torch.testing.assert_close(logprobs[:chunk], old_reference[:chunk], atol=ATOL, rtol=0)
        torch.testing.assert_close(logprobs[chunk:], new_reference[chunk:], atol=ATOL, rtol=0)
        # The perturbation really changed the distribution (so the check above means something).
        assert (logprobs[chunk:] - old_reference[chunk:]).abs().max() > 1e-2


def slow_down_forward(model, seconds=0.005):
    """Make each forward pass sleep so another thread can act mid-generation reliably."""
    return model.register_forward_pre_hook(lambda module, args: time.sleep(seconds))


def wait_until(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the decode loop"
        time.sleep(0.0005)


def test_update_from_another_thread_while_generate_runs(tiny_dir, engine):
    old_model = HFRolloutEngine(tiny_dir).model
    new_weights = perturbed_state_dict(engine.model)
    num_tokens = 200  # ~1 s of slowed decoding: the other thread acts mid-generation even on a loaded machine
    sampling = SamplingParams(temperature=1.0, max_new_tokens=num_tokens, ignore_eos=True)
    result = {}
    hook = slow_down_forward(engine.model)
    requests = make_requests(engine, sampling)
    worker = threading.Thread(target=lambda: result.setdefault("outputs", engine.generate(requests)))
    worker.start()
    wait_until(lambda: engine.num_decode_steps >= 5)
    engine.pause(wait=True)  # returns once the decode loop is parked at a token boundary
    parked_at = engine.num_decode_steps
    engine.update_weights(new_weights, version=3)  # queued, applied by the parked loop
    assert engine.policy_version == 3
    assert engine.num_decode_steps == parked_at  # nothing was generated while paused
    engine.resume()
    worker.join(timeout=60)
    hook.remove()
    assert not worker.is_alive()
    assert 5 <= parked_at < num_tokens

    for output in result["outputs"]:
        assert output.versions == [0] * parked_at + [3] * (num_tokens - parked_at)
        logprobs = torch.tensor(output.logprobs)
        old_reference = teacher_forced_logprobs(old_model, output, temperature=1.0)
        new_reference = teacher_forced_logprobs(engine.model, output, temperature=1.0)
        torch.testing.assert_close(logprobs[:parked_at], old_reference[:parked_at], atol=ATOL, rtol=0)
        torch.testing.assert_close(logprobs[parked_at:], new_reference[parked_at:], atol=ATOL, rtol=0)


def test_nonblocking_update_during_generate_is_applied_at_a_token_boundary(engine):
    new_weights = perturbed_state_dict(engine.model)
    num_tokens = 200  # ~1 s of slowed decoding: the update/abort lands mid-generation even on a loaded machine
    result = {}
    hook = slow_down_forward(engine.model)
    requests = make_requests(engine, SamplingParams(max_new_tokens=num_tokens, ignore_eos=True))
    worker = threading.Thread(target=lambda: result.setdefault("outputs", engine.generate(requests)))
    worker.start()
    wait_until(lambda: engine.num_decode_steps >= 3)
    engine.update_weights(new_weights, version=1, blocking=False)
    worker.join(timeout=60)
    hook.remove()
    assert engine.policy_version == 1
    for output in result["outputs"]:
        switch = output.versions.index(1)  # raises if the update never reached the loop
        assert 3 <= switch < num_tokens
        assert output.versions == [0] * switch + [1] * (num_tokens - switch)


def test_abort_from_another_thread_while_generate_runs(engine):
    num_tokens = 200  # ~1 s of slowed decoding: the update/abort lands mid-generation even on a loaded machine
    result = {}
    hook = slow_down_forward(engine.model)
    requests = make_requests(engine, SamplingParams(max_new_tokens=num_tokens, ignore_eos=True))
    worker = threading.Thread(target=lambda: result.setdefault("outputs", engine.generate(requests)))
    worker.start()
    wait_until(lambda: engine.num_decode_steps >= 3)
    assert engine.abort(["r1"]) == []  # queued: generate() returns the aborted output
    worker.join(timeout=60)
    hook.remove()
    by_id = {o.request_id: o for o in result["outputs"]}
    assert [o.request_id for o in result["outputs"]] == ["r0", "r1", "r2"]
    assert by_id["r1"].finish_reason == "aborted" and 3 <= by_id["r1"].num_tokens < num_tokens
    assert by_id["r0"].finish_reason == by_id["r2"].finish_reason == "length"


def test_requests_joining_a_running_batch(engine):
    """Continuous batching: newcomers are prefilled and merged into the running KV cache."""
    first_wave = [
        GenerationRequest(f"a{i}", ids, SamplingParams(max_new_tokens=n, seed=i, ignore_eos=True))
        for i, (ids, n) in enumerate(zip(encode_prompts(engine), (12, 5, 9)))  # longest prompt ends first
    ]
    second_wave = [
        GenerationRequest("b0", [7], SamplingParams(max_new_tokens=10, seed=10, ignore_eos=True)),  # empty prefix
        GenerationRequest("b1", list(range(20, 80)), SamplingParams(max_new_tokens=6, seed=11, ignore_eos=True)),
    ]
    alone = {o.request_id: o for o in engine.generate(first_wave) + engine.generate(second_wave)}

    engine.start(first_wave)
    outputs = engine.step(3)
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_requests([GenerationRequest("a0", [1])])
    engine.add_requests(second_wave)
    outputs += engine.step()
    assert sorted(o.request_id for o in outputs) == ["a0", "a1", "a2", "b0", "b1"]
    for output in outputs:
        reference = teacher_forced_logprobs(engine.model, output, temperature=1.0)
        torch.testing.assert_close(torch.tensor(output.logprobs), reference, atol=ATOL, rtol=0)
        # Same seed, same weights: joining mid-way does not change what a request samples.
        assert output.token_ids == alone[output.request_id].token_ids


def test_abort_between_chunks(engine):
    engine.start(make_requests(engine, SamplingParams(max_new_tokens=20, ignore_eos=True)))
    engine.step(3)
    aborted = engine.abort(["r1"])
    assert [(o.request_id, o.finish_reason, o.num_tokens) for o in aborted] == [("r1", "aborted", 3)]
    rest = engine.step()
    assert sorted((o.request_id, o.finish_reason, o.num_tokens) for o in rest) == [
        ("r0", "length", 20),
        ("r2", "length", 20),
    ]


def test_invalid_update_and_requests_raise_clear_errors(engine):
    with pytest.raises(ValueError, match="not parameters of the rollout model"):
        engine.update_weights({"module.lm_head.weight": torch.zeros(1)}, version=5)
    with pytest.raises(ValueError, match="shape mismatch"):
        engine.update_weights({"lm_head.weight": torch.zeros(2, 2)}, version=5)
    assert engine.policy_version == 0
    with pytest.raises(ValueError, match="outside"):
        engine.generate([GenerationRequest("x", [engine.vocab_size + 3])])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.generate([GenerationRequest("x", [1] * engine.max_positions)])
    with pytest.raises(ValueError, match="duplicate"):
        engine.generate([GenerationRequest("x", [1]), GenerationRequest("x", [2])])
    engine.pause()
    with pytest.raises(RuntimeError, match="resume"):
        engine.generate([GenerationRequest("x", [1])])
