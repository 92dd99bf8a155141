"""The rollout hot path (issue 13, item 6): batched per-request random streams, cached tokenisation, and env
calls on persistent workers -- each checked against the slow, obvious version it replaces."""

from __future__ import annotations

import threading

import pytest
import torch

from async_rl.driver.episode import ChatFormatter, EpisodeLimits
from async_rl.envs.base import Env, StepResult
from async_rl.envs.calls import default_env_pool, run_env_reset, run_env_step
from async_rl.rollout.hf_engine import _stream_uniform_reference, stream_key, stream_uniforms


# ------------------------------------------------------------------------------------------------------
# random streams
# ------------------------------------------------------------------------------------------------------
def test_batched_stream_draws_equal_the_scalar_splitmix64_reference():
    # keys from small and huge seeds (the int64 wrap-around and the sign bit are exercised), draws up to 2**40
    keys = [stream_key(s) for s in (0, 1, 2, 7, 2**31 - 1, 2**62 + 12345)]
    draws = [0, 1, 2, 1000, 2**33 + 5, 2**40]
    batched = stream_uniforms(torch.tensor(keys), torch.tensor(draws)).tolist()
    assert batched == [_stream_uniform_reference(k, d) for k, d in zip(keys, draws)]  # bit for bit
    # known SplitMix64 value: the first output of state 0 is 0xE220A8397B1DCDAF (Vigna's reference code)
    assert _stream_uniform_reference(0, 0) == (0xE220A8397B1DCDAF >> 11) * 2.0**-53


def test_a_request_stream_does_not_depend_on_the_other_rows():
    key = stream_key(42)
    alone = stream_uniforms(torch.tensor([key]), torch.tensor([7])).item()
    crowd = stream_uniforms(torch.tensor([stream_key(1), key, stream_key(3)]), torch.tensor([0, 7, 99]))
    assert crowd[1].item() == alone


def test_stream_draws_look_uniform():
    # 20,000 draws of one stream: mean 1/2 and variance 1/12 within ~5 standard errors, all in [0, 1)
    u = stream_uniforms(torch.full((20_000,), stream_key(5)), torch.arange(20_000))
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 5 * (1 / 12 / 20_000) ** 0.5
    assert abs(float(u.var()) - 1 / 12) < 0.005
    # neighbouring seeds give unrelated streams (the seed is mixed before use)
    v = stream_uniforms(torch.full((20_000,), stream_key(6)), torch.arange(20_000))
    assert abs(float(torch.corrcoef(torch.stack([u, v]))[0, 1])) < 0.05


# ------------------------------------------------------------------------------------------------------
# cached tokenisation
# ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from async_rl.models.loading import load_tokenizer
    from async_rl.models.tiny import make_tiny_model

    return load_tokenizer(make_tiny_model(tmp_path_factory.mktemp("tok") / "m", hidden_size=32, num_layers=1))


def test_cached_formatter_gives_exactly_the_uncached_tokens(tokenizer):
    formatter = ChatFormatter(tokenizer, system_prompt="be brief")
    for text in ["Find the key.", "Find the key.", " leading space", "12 + 7 = ?", "Find the key."]:
        expected = tokenizer.apply_chat_template([{"role": "system", "content": "be brief"},
                                                  {"role": "user", "content": text}],
                                                 add_generation_prompt=True, tokenize=True)
        expected = list(expected["input_ids"] if not isinstance(expected, list) else expected)
        assert formatter.prompt_ids(text) == expected
    for obs, closed in [("The key is 7.", True), ("The key is 7.", False), ("The key is 7.", True), ("", True)]:
        prefix = "\n" if closed else "<|im_end|>\n"
        whole = f"{prefix}<|im_start|>user\n{obs}<|im_end|>\n<|im_start|>assistant\n"
        assert formatter.observation_ids(obs, closed) == tokenizer(whole, add_special_tokens=False)["input_ids"]
    # repeats were served from the cache: 3 distinct prompts of 5, 3 distinct observations of 4
    assert (formatter._prompt_cache.hits, formatter._prompt_cache.misses) == (2, 3)
    assert (formatter._observation_cache.hits, formatter._observation_cache.misses) == (1, 3)


def test_the_observation_frame_comes_from_the_models_chat_template(tmp_path_factory):
    """Not ChatML by assumption: a Llama 3 template frames observations with its own header tokens, ends a turn
    with <|eot_id|> (the rollout's stop token), and a model that did not close its turn gets the close first."""
    from async_rl.driver.episode import ChatFrame
    from async_rl.models.loading import load_tokenizer
    from async_rl.models.tiny import make_tiny_model

    tok = load_tokenizer(make_tiny_model(tmp_path_factory.mktemp("llama3") / "m", hidden_size=32, num_layers=1))
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = (
        "{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim"
        " + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
    formatter = ChatFormatter(tok)
    assert formatter.end_token_id == tok.convert_tokens_to_ids("<|eot_id|>")
    user_turn = "<|start_header_id|>user<|end_header_id|>\n\nThe key is 7.<|eot_id|>"
    reopen = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert formatter.frame.observation_text("The key is 7.", True) == user_turn + reopen
    assert formatter.frame.observation_text("The key is 7.", False) == "<|eot_id|>" + user_turn + reopen
    assert formatter.observation_ids("The key is 7.", True) == tok(user_turn + reopen, add_special_tokens=False)["input_ids"]

    # Qwen3-style: the last assistant turn keeps a <think> block that earlier ones drop; the close is the same
    tok.chat_template = (
        "{%- set ns = namespace(last_query=-1) %}{%- for m in messages %}{%- if m['role'] == 'user' %}"
        "{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}{%- for m in messages %}"
        "{%- if m['role'] == 'assistant' and loop.index0 > ns.last_query %}"
        "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{%- else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
        "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
    qwen3 = ChatFrame.from_tokenizer(tok)
    assert qwen3.end_token == "<|im_end|>"
    assert qwen3.observation_text("obs", True) == "\n<|im_start|>user\nobs<|im_end|>\n<|im_start|>assistant\n"

    # a template that ends a turn one way when it is last and another when a user turn follows cannot be appended to
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% if loop.last %}<END>{% else %}<SEP>{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match="closes an assistant turn differently"):
        ChatFrame.from_tokenizer(tok)
    with pytest.raises(ValueError, match="closes an assistant turn differently"):
        ChatFormatter(tok).observation_ids("obs", True)  # the formatter raises where the frame is needed


def test_cached_token_lists_are_fresh_copies(tokenizer):
    formatter = ChatFormatter(tokenizer)
    first = formatter.observation_ids("Invalid action.", True)
    first.append(-1)  # a trajectory extending its list must not corrupt the cache
    assert formatter.observation_ids("Invalid action.", True) == first[:-1]


def test_the_cache_is_bounded(tokenizer):
    formatter = ChatFormatter(tokenizer)
    formatter._observation_cache.max_entries = 4
    for i in range(10):
        formatter.observation_ids(f"obs {i}", True)
    assert len(formatter._observation_cache._ids) == 4
    long_text = "x" * (formatter._observation_cache.max_chars + 1)
    formatter.observation_ids(long_text, True)  # too long to cache: tokenised, not stored
    assert all(key[0] != long_text for key in formatter._observation_cache._ids)


# ------------------------------------------------------------------------------------------------------
# env calls on persistent workers
# ------------------------------------------------------------------------------------------------------
class _Echo(Env):
    def reset(self, task):
        return "go"

    def step(self, action_text):
        return StepResult(threading.current_thread().name, 0.0, False)


def test_env_steps_reuse_the_default_pool_workers():
    env = _Echo()
    run_env_reset(env, {}, timeout_s=5)
    started_before = default_env_pool()._started_threads
    names = {run_env_step(env, "a", timeout_s=5).result.observation for _ in range(300)}
    # 300 sequential steps off the caller's thread, and no new thread was needed for them
    assert threading.current_thread().name not in names and all(n.startswith("env-call-default") for n in names)
    assert default_env_pool()._started_threads == started_before


@pytest.mark.parametrize(("field", "value", "message"), [
    ("env_timeout_s", 0, "env.env_timeout_s=0"), ("env_timeout_s", float("inf"), "finite"),
    ("env_timeout_s", "30", "env.env_timeout_s='30'"), ("max_turns", 0, "env.max_turns=0"),
    ("max_response_tokens", -1, "env.max_response_tokens=-1"), ("max_turns", 2.5, "integer"),
])
def test_episode_limits_reject_bad_values_with_the_key_in_the_message(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        EpisodeLimits(**{field: value})
