"""SFT warm start: assistant-only loss mask, demonstration content, a short training run, the CLI."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from async_rl.envs.toy import TOY_KEYS_PROMPT, make_toy_tasks, observation_text
from async_rl.models.loading import load_causal_lm, load_tokenizer
from async_rl.models.sft import (
    DEFAULTS,
    IGNORE_INDEX,
    main as sft_main,
    make_noisy_demonstrations,
    sample_success_rate,
    sft_warm_start,
    think_filler,
    tokenize_conversation,
)
from async_rl.models.tiny import make_tiny_model


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("sft") / "small",
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        max_position_embeddings=512,
    )


@pytest.fixture(scope="module")
def tokenizer(small_model_dir):
    return load_tokenizer(small_model_dir)


def _runs(mask):
    """(start, end) of each maximal run of 1s."""
    runs, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_loss_mask_covers_exactly_the_assistant_tokens(tokenizer):
    first, second = "<think> so the key </think>\nlook", "open 7"
    messages = [
        {"role": "user", "content": TOY_KEYS_PROMPT},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "The key is 7."},
        {"role": "assistant", "content": second},
    ]
    out = tokenize_conversation(messages, tokenizer)
    ids, labels, mask = out["input_ids"], out["labels"], out["loss_mask"]
    assert len(ids) == len(labels) == len(mask)
    assert all((lab == tok) if m else (lab == IGNORE_INDEX) for tok, lab, m in zip(ids, labels, mask))

    trained = [tok for tok, m in zip(ids, mask) if m]
    assert tokenizer.decode(trained) == f"{first}<|im_end|>{second}<|im_end|>"
    runs = _runs(mask)
    assert [tokenizer.decode(ids[a:b]) for a, b in runs] == [f"{first}<|im_end|>", f"{second}<|im_end|>"]
    untrained = [tokenizer.decode(ids[b:c]) for (_, b), (c, _) in zip(runs, runs[1:])]
    assert untrained == [observation_text("The key is 7.")]

    # Same ids as the rollout builds them: prompt ids + generated ids + observation ids + generated ids.
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    rollout = []
    for piece in (prompt, first + "<|im_end|>", observation_text("The key is 7."), second + "<|im_end|>"):
        rollout += tokenizer.encode(piece, add_special_tokens=False)
    assert ids == rollout
    # ... and the chat template's own tokenisation, minus its trailing newline.
    templated = tokenizer.apply_chat_template(messages, tokenize=False)
    assert templated.endswith("<|im_end|>\n")
    assert ids == tokenizer.encode(templated[:-1], add_special_tokens=False)


def test_think_filler_is_geometric_and_long_tailed():
    import random

    rng = random.Random(0)
    lengths = []
    for _ in range(4000):
        text = think_filler(rng, 3.0, max_words=200)
        lengths.append(0 if not text else len(text.split()) - 2)
        if text:
            assert text.startswith("<think> ") and text.endswith(" </think>\n")
            assert not any(ch.isdigit() for ch in text)
    assert 2.7 < statistics.mean(lengths) < 3.3
    assert 0.2 < lengths.count(0) / len(lengths) < 0.3  # P(k=0) = 1/(1+mean) = 0.25
    assert max(lengths) > 20  # long tail
    assert think_filler(rng, 0.0) == ""
    assert all(len(think_filler(rng, 50.0, max_words=8).split()) <= 10 for _ in range(100))


def test_demonstrations_follow_the_noise_level(tokenizer):
    tasks = make_toy_tasks("toy_keys", 400, seed=0)
    clean = make_noisy_demonstrations("toy_keys", tasks, tokenizer, noise=0.0, think_tokens_mean=2.0, seed=0)
    assert all(d["success"] and d["reward"] == 1.0 and not d["noisy"] for d in clean)
    for demo in clean[:20]:
        roles = [m["role"] for m in demo["messages"]]
        assert roles == ["user", "assistant", "user", "assistant"]
        assert demo["messages"][2]["content"] == f"The key is {tasks[clean.index(demo)]['key']}."
        assert demo["messages"][1]["content"].endswith("look")

    noisy = make_noisy_demonstrations("toy_keys", tasks, tokenizer, noise=1.0, think_tokens_mean=2.0, seed=0)
    assert all(d["noisy"] for d in noisy)
    assert sum(d["success"] for d in noisy) / len(noisy) < 0.12  # only lucky blind guesses
    blind = sum(len(d["messages"]) == 2 for d in noisy) / len(noisy)
    assert 0.4 < blind < 0.6

    # blind_fraction splits the wrong demos between guessing without looking and looking then opening wrong
    all_blind = make_noisy_demonstrations("toy_keys", tasks[:100], tokenizer, noise=1.0, think_tokens_mean=0.0,
                                          seed=0, blind_fraction=1.0)
    assert all(len(d["messages"]) == 2 and d["messages"][1]["content"].startswith("open ") for d in all_blind)
    all_look = make_noisy_demonstrations("toy_keys", tasks[:100], tokenizer, noise=1.0, think_tokens_mean=0.0,
                                         seed=0, blind_fraction=0.0)
    assert all(len(d["messages"]) == 4 and not d["success"] for d in all_look)  # looked, then opened a wrong digit
    with pytest.raises(ValueError, match="blind_fraction"):
        make_noisy_demonstrations("toy_keys", tasks[:2], tokenizer, noise=0.5, blind_fraction=1.5)

    half = make_noisy_demonstrations("toy_keys", tasks, tokenizer, noise=0.5, think_tokens_mean=2.0, seed=0)
    assert 0.4 < sum(d["noisy"] for d in half) / len(half) < 0.6
    again = make_noisy_demonstrations("toy_keys", tasks, tokenizer, noise=0.5, think_tokens_mean=2.0, seed=0)
    assert [d["input_ids"] for d in again] == [d["input_ids"] for d in half]

    echo_tasks = make_toy_tasks("toy_echo", 300, seed=0)
    echo = make_noisy_demonstrations("toy_echo", echo_tasks, tokenizer, noise=0.7, think_tokens_mean=0.0, seed=1)
    assert all(len(d["messages"]) == 2 and d["messages"][1]["content"].startswith("\\boxed{") for d in echo)
    assert all(d["success"] != d["noisy"] for d in echo)
    assert 0.2 < sum(d["success"] for d in echo) / len(echo) < 0.4


def test_default_toy_keys_warm_start_fails_only_by_not_looking(tokenizer):
    """The default noise model makes the outcome visible to a frozen-attention critic: every demonstration
    that looks succeeds and every wrong one skipped `look`, so whether an observation is in the context
    decides the reward (docs/toy_tasks.md, "Why the critic can learn here")."""
    tasks = make_toy_tasks("toy_keys", 300, seed=3)
    demos = make_noisy_demonstrations("toy_keys", tasks, tokenizer, noise=DEFAULTS["toy_keys"]["noise"],
                                      think_tokens_mean=1.0, seed=3,
                                      blind_fraction=DEFAULTS["toy_keys"]["blind_fraction"])
    looked = [d for d in demos if len(d["messages"]) == 4]
    blind = [d for d in demos if len(d["messages"]) == 2]
    assert len(looked) + len(blind) == len(demos)
    assert looked and all(d["success"] for d in looked)
    assert all(d["noisy"] for d in blind)
    # 70 % noisy demos guess blindly; a blind guess is right 1 time in 10: 0.3 + 0.7 * 0.1 = 0.37
    assert 0.3 < sum(d["success"] for d in demos) / len(demos) < 0.45


def test_short_sft_run_lowers_the_loss_and_saves(small_model_dir, tmp_path):
    out = tmp_path / "warm"
    before = torch.get_num_threads()
    stats = sft_warm_start(
        small_model_dir, out, env_name="toy_keys", num_demos=64, noise=0.5, steps=30, lr=1e-2,
        batch_size=8, seed=0, think_tokens_mean=1.0, warmup_steps=5,
    )
    assert torch.get_num_threads() == before
    assert len(stats["losses"]) == 30 and stats["steps"] == 30 and stats["clean_steps"] == 20
    assert all(torch.isfinite(torch.tensor(stats["losses"])))
    assert stats["final_loss"] < 0.7 * stats["initial_loss"]
    assert stats["seconds"] < 60
    assert json.loads((out / "sft_stats.json").read_text())["final_loss"] == stats["final_loss"]

    model, tok = load_causal_lm(out), load_tokenizer(out)
    assert tok("look")["input_ids"] == load_tokenizer(small_model_dir)("look")["input_ids"]
    original = load_causal_lm(small_model_dir)
    assert not torch.equal(model.lm_head.weight, original.lm_head.weight)

    result = sample_success_rate(model, tok, "toy_keys", make_toy_tasks("toy_keys", 4, seed=9), max_new_tokens=8)
    # a success rate over 4 tasks is k/4, and the same seed replays the same episodes
    assert result["num_tasks"] == 4 and result["success_rate"] * 4 == int(result["success_rate"] * 4)
    assert sample_success_rate(model, tok, "toy_keys", make_toy_tasks("toy_keys", 4, seed=9), max_new_tokens=8) == result
    assert 1.0 <= result["mean_turns"] <= 4.0 and 1 <= result["max_response_tokens"] <= 8


def test_cli_trains_both_envs(small_model_dir, tmp_path, capsys):
    out = tmp_path / "cli"
    report = sft_main([
        "--model", str(small_model_dir), "--out", str(out), "--env", "toy_keys,toy_echo",
        "--num-demos", "20", "--steps", "3", "--batch-size", "4", "--eval-tasks", "2",
    ])
    assert report["env_names"] == ["toy_keys", "toy_echo"] and report["num_demos"] == 20
    assert [e["env"] for e in report["eval"]] == ["toy_keys", "toy_echo"]
    assert json.loads(capsys.readouterr().out)["steps"] == 3
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
