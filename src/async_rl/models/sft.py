"""Supervised warm start on noisy demonstrations: the toy tasks (``toy_keys`` / ``toy_echo``) and, for the
SIZE=tiny recipes, scripted episodes of the real tasks (math, retool, alfworld, webshop;
:func:`sft_warm_start_on_tasks`, see the last section and recipes/README.md).

A randomly initialised tiny model cannot even produce the action format, so RL on it would never see a
reward. :func:`sft_warm_start` fine-tunes it on chat-formatted demonstrations of which a fraction
``noise`` are deliberately wrong, so that the result behaves like a weak pretrained model: it knows the
format and sometimes solves the task (roughly 15-50 % success at temperature 1), leaving RL room to
improve.

Training has two phases under one optimizer: the first ``clean_fraction`` of the steps use clean
demonstrations (the model learns the format and to read the digit from the prompt/observation; under
heavy noise alone the tiny model does not learn that copy within a CPU-friendly budget), the rest use
the noisy ones, which pull the policy's success rate down to about the demonstrations' success rate.

Demonstrations are rendered with the tokenizer's own chat template and tokenised turn by turn, exactly
as the multi-turn rollout builds its context:

* prompt = ``apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)``;
* each assistant message = its text + ``<|im_end|>`` (the only tokens with a loss);
* each observation = :func:`async_rl.envs.toy.observation_text` ``(obs)``, i.e. the chat template's
  ``\\n<|im_start|>user\\n{obs}<|im_end|>\\n<|im_start|>assistant\\n`` (no loss).

An assistant message is ``[<think> w1 ... wk </think>\\n]ACTION`` with ``k`` geometric (mean
``think_tokens_mean``, ``k = 0`` means no thinking block), so response lengths are long-tailed.

CLI::

    python -m async_rl.models.sft --model DIR --out DIR --env toy_keys [--noise 0.7 --steps 450 ...]
        [--eval-tasks 100]   # also sample the result at temperature 1 and print its success rate
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from async_rl.envs.toy import (
    TOY_ENV_NAMES,
    ToyEchoEnv,
    ToyKeysEnv,
    make_toy_tasks,
    observation_text,
)

__all__ = [
    "DEFAULTS",
    "IGNORE_INDEX",
    "TASK_DEFAULTS",
    "TASK_DEMO_ENVS",
    "make_noisy_demonstrations",
    "make_task_demonstrations",
    "sample_success_rate",
    "sft_warm_start",
    "sft_warm_start_on_tasks",
    "think_filler",
    "tokenize_conversation",
]

IGNORE_INDEX = -100
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"

# Defaults chosen so the default tiny model lands in the target success band (see docs/toy_tasks.md).
DEFAULTS: dict[str, dict[str, Any]] = {
    "toy_keys": {"noise": 0.7, "steps": 450, "clean_fraction": 2 / 3, "blind_fraction": 1.0},
    "toy_echo": {"noise": 0.7, "steps": 450, "clean_fraction": 2 / 3},
}
DEFAULT_NUM_DEMOS = 1024
DEFAULT_LR = 6e-3
DEFAULT_BATCH_SIZE = 32
DEFAULT_THINK_TOKENS_MEAN = 3.0
MAX_THINK_WORDS = 48

# Filler words for the thinking block: no digits, no action words, all cheap in the tiny BPE.
_FILLER_WORDS: tuple[str, ...] = (
    "so", "the", "is", "let", "we", "have", "to", "find", "and", "then", "it", "be", "think", "step",
    "what", "not", "yes", "no", "a", "of", "in", "on", "with", "get", "final",
)


# --------------------------------------------------------------------------------------------------
# Chat rendering and loss masks
# --------------------------------------------------------------------------------------------------


def _render(tokenizer, messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
    )


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def tokenize_conversation(messages: Sequence[dict[str, str]], tokenizer) -> dict[str, list[int]]:
    """Token ids of a chat and its loss mask: 1 exactly on each assistant message's text + ``<|im_end|>``.

    The text is produced by the tokenizer's chat template. It is cut at the boundaries of the assistant
    spans and every piece is encoded separately, which is how the rollout builds the same sequence
    (prompt ids, then generated ids, then observation ids); what follows the last assistant
    ``<|im_end|>`` (the template's trailing newline) is dropped, since generation stops at ``<|im_end|>``.

    Returns ``{"input_ids", "labels" (IGNORE_INDEX where masked), "loss_mask"}``.
    """
    messages = list(messages)
    input_ids: list[int] = []
    loss_mask: list[int] = []
    consumed = ""  # rendered text already turned into tokens

    def add(text: str, trained: bool) -> None:
        ids = _encode(tokenizer, text)
        input_ids.extend(ids)
        loss_mask.extend([1 if trained else 0] * len(ids))

    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], add_generation_prompt=True)
        full = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        target = message["content"] + IM_END
        if not prefix.startswith(consumed) or not full.startswith(prefix + target):
            raise ValueError(
                "the tokenizer's chat template does not render the conversation incrementally as "
                "'...<generation prompt>{content}<|im_end|>'; cannot build assistant-only loss masks"
            )
        add(prefix[len(consumed):], trained=False)
        add(target, trained=True)
        consumed = prefix + target
    rest = _render(tokenizer, messages, add_generation_prompt=False)[len(consumed):]
    if rest.strip():
        add(rest, trained=False)
    labels = [tok if m else IGNORE_INDEX for tok, m in zip(input_ids, loss_mask)]
    return {"input_ids": input_ids, "labels": labels, "loss_mask": loss_mask}


# --------------------------------------------------------------------------------------------------
# Demonstrations
# --------------------------------------------------------------------------------------------------


def think_filler(rng: random.Random, mean_words: float, max_words: int = MAX_THINK_WORDS) -> str:
    """``"<think> w1 ... wk </think>\\n"`` with ``k ~ Geometric`` (mean ``mean_words``, capped), "" if k == 0."""
    if mean_words <= 0:
        return ""
    continue_prob = mean_words / (1.0 + mean_words)  # P(k >= j+1 | k >= j); E[k] = mean_words
    k = int(math.floor(math.log(1.0 - rng.random()) / math.log(continue_prob)))
    k = min(k, max_words)
    if k == 0:
        return ""
    return "<think> " + " ".join(rng.choice(_FILLER_WORDS) for _ in range(k)) + " </think>\n"


def _demo_actions(env_name: str, task: dict[str, Any], noisy: bool, rng: random.Random,
                  blind_fraction: float) -> list[str]:
    """Bare action sequence of one demonstration (observations come from the env itself)."""
    if env_name == "toy_keys":
        key = int(task["key"])
        if not noisy:
            return ["look", f"open {key}"]
        if rng.random() < blind_fraction:  # blind guess: skip `look` (right 10 % of the time by luck)
            return [f"open {rng.randrange(10)}"]
        wrong = rng.choice([d for d in range(10) if d != key])
        return ["look", f"open {wrong}"]
    code = int(task["code"])
    digit = rng.choice([d for d in range(10) if d != code]) if noisy else code
    return [f"\\boxed{{{digit}}}"]


def make_noisy_demonstrations(
    env_name: str | None,
    tasks: Sequence[dict[str, Any]],
    tokenizer,
    noise: float,
    think_tokens_mean: float = DEFAULT_THINK_TOKENS_MEAN,
    seed: int = 0,
    blind_fraction: float = 0.5,
) -> list[dict[str, Any]]:
    """One chat-formatted demonstration per task, a fraction ``noise`` of them with wrong actions.

    Clean ``toy_keys`` demos play ``look`` then ``open <key>``; noisy ones either guess blindly
    (``open <random digit>`` right away, a fraction ``blind_fraction`` of them) or look and then open a
    wrong digit (the rest). Clean ``toy_echo`` demos box the code, noisy ones box another digit. Each
    assistant message may start with a thinking filler (:func:`think_filler`). The episode is played
    through the real env, so the user turns carry its observations verbatim and ``reward`` is the env's
    reward.

    ``env_name`` None takes each task's ``"env"`` field. Returns dicts with ``id``, ``env``, ``messages``
    (user prompt, then alternating assistant / user-observation turns), ``noisy``, ``reward``,
    ``success``, ``input_ids``, ``labels`` and ``loss_mask`` (see :func:`tokenize_conversation`).
    """
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise must be in [0, 1], got {noise}")
    if not 0.0 <= blind_fraction <= 1.0:
        raise ValueError(f"blind_fraction must be in [0, 1], got {blind_fraction}")
    rng = random.Random(seed)
    demos: list[dict[str, Any]] = []
    for task in tasks:
        name = env_name or task.get("env")
        if name not in TOY_ENV_NAMES:
            raise ValueError(f"unknown toy env {name!r} for task {task.get('id', '?')!r}; valid: {TOY_ENV_NAMES}")
        noisy = rng.random() < noise
        env = ToyKeysEnv() if name == "toy_keys" else ToyEchoEnv()
        messages = [{"role": "user", "content": env.reset(task)}]
        result = None
        for action in _demo_actions(name, task, noisy, rng, blind_fraction):
            text = think_filler(rng, think_tokens_mean) + action
            if messages[-1]["role"] == "assistant":
                messages.append({"role": "user", "content": result.observation})
            messages.append({"role": "assistant", "content": text})
            result = env.step(text)
            if result.done:
                break
        assert result is not None and result.done, f"demonstration for {task.get('id')} did not finish"
        demo = {
            "id": task.get("id"),
            "env": name,
            "messages": messages,
            "noisy": noisy,
            "reward": float(result.reward),
            "success": bool(result.info.get("success", False)),
        }
        demo.update(tokenize_conversation(messages, tokenizer))
        demos.append(demo)
    return demos


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


def _collate(batch: Sequence[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(d["input_ids"]) for d in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for row, demo in enumerate(batch):
        n = len(demo["input_ids"])
        ids[row, :n] = torch.tensor(demo["input_ids"])
        labels[row, :n] = torch.tensor(demo["labels"])
        attention[row, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": attention}


def _assistant_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled (assistant) positions of the batch."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        batch["labels"][:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
    )


@contextlib.contextmanager
def _torch_threads(num_threads: int | None):
    """Temporarily set torch's intra-op CPU threads (None: leave as is)."""
    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _train(model, phases, pad_id, lr, batch_size, rng, warmup_steps, log_every, losses) -> None:
    """AdamW on the assistant-token loss; appends each step's loss to ``losses``.

    ``phases`` is ``[(demos, num_steps), ...]``, trained in order under one optimizer and one learning
    rate schedule (linear warmup, then cosine decay to 10 % of ``lr``); batches are sampled with
    replacement from the current phase's demos.
    """
    steps = sum(n for _, n in phases)
    step_demos = [demos for demos, n in phases for _ in range(n)]
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)

    def lr_factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    for step, demos in enumerate(step_demos):
        batch = _collate([demos[rng.randrange(len(demos))] for _ in range(batch_size)], pad_id)
        loss = _assistant_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
        if log_every and (step + 1) % log_every == 0:
            print(f"[sft] step {step + 1}/{steps} loss {losses[-1]:.4f}", flush=True)
    model.eval()


def _split_env_names(env_name: str | Sequence[str]) -> list[str]:
    names = [n.strip() for n in env_name.split(",")] if isinstance(env_name, str) else [str(n) for n in env_name]
    names = [n for n in names if n]
    bad = [n for n in names if n not in TOY_ENV_NAMES]
    if not names or bad:
        raise ValueError(f"env_name must name toy envs from {TOY_ENV_NAMES}, got {env_name!r}")
    return names


def sft_warm_start(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    env_name: str | Sequence[str] = "toy_keys",
    num_demos: int = DEFAULT_NUM_DEMOS,
    noise: float | None = None,
    steps: int | None = None,
    lr: float = DEFAULT_LR,
    batch_size: int = DEFAULT_BATCH_SIZE,
    seed: int = 0,
    think_tokens_mean: float = DEFAULT_THINK_TOKENS_MEAN,
    clean_fraction: float | None = None,
    blind_fraction: float | None = None,
    warmup_steps: int = 20,
    log_every: int = 0,
    num_threads: int | None = 1,
) -> dict[str, Any]:
    """Fine-tune the model in ``model_dir`` on noisy demonstrations and save it (+ tokenizer) to ``out_dir``.

    Args:
        model_dir: local HF checkpoint directory (e.g. from :func:`async_rl.models.tiny.make_tiny_model`).
        out_dir: where ``save_pretrained`` writes the warm-started model and tokenizer (created).
        env_name: ``"toy_keys"``, ``"toy_echo"``, or several (list or comma-separated string): the
            demonstrations are then split evenly between them.
        num_demos: number of demonstrations (tasks from ``make_toy_tasks(env, n, seed=1000 + seed)``).
        noise: fraction of wrong demonstrations; None takes :data:`DEFAULTS` (mean over the envs).
        steps: optimizer steps; None takes :data:`DEFAULTS` (max over the envs).
        lr: AdamW peak learning rate (linear warmup over ``warmup_steps``, then cosine decay to 10 %).
        batch_size: demonstrations per step (sampled with replacement).
        seed: seeds the demonstrations, the batch order and torch (the global torch RNG is restored).
        think_tokens_mean: mean length in words of the optional ``<think>`` filler (0 disables it).
        clean_fraction: fraction of the steps (the first ones) trained on clean (noise 0) versions of the
            same demonstrations; None takes :data:`DEFAULTS` (min over the envs).
        blind_fraction: ``toy_keys``: fraction of the wrong demonstrations that guess without looking
            (the rest look and open a wrong digit); None takes :data:`DEFAULTS`.
        warmup_steps: linear learning-rate warmup.
        log_every: print the loss every this many steps (0: silent).
        num_threads: torch CPU threads while training (restored afterwards); None leaves the setting.
            The default 1 is the fastest for the tiny model: its matrices are too small to split, and
            extra threads only fight over shared cores (2 threads were ~10x slower on a busy 2-core box).

    The loss is next-token cross-entropy on assistant tokens only (each action's text + ``<|im_end|>``).

    Returns stats: ``initial_loss``, ``final_loss`` (mean of the last 10 steps), ``losses`` (every step),
    ``seconds``, ``steps``, ``clean_steps``, ``num_demos``, ``noise``, ``demo_success_rate`` (of the noisy
    demonstrations), ``mean_demo_tokens``, ``mean_assistant_tokens``, ``env_names``, ``out_dir``, and the
    hyper-parameters. They are also written to ``out_dir/sft_stats.json``.
    """
    from async_rl.models.loading import load_causal_lm, load_tokenizer

    started = time.monotonic()
    names = _split_env_names(env_name)
    if noise is None:
        noise = sum(DEFAULTS[n]["noise"] for n in names) / len(names)
    if steps is None:
        steps = max(DEFAULTS[n]["steps"] for n in names)
    if clean_fraction is None:
        clean_fraction = min(DEFAULTS[n]["clean_fraction"] for n in names)
    if blind_fraction is None:
        blind_fraction = DEFAULTS["toy_keys"]["blind_fraction"]
    if not 0.0 <= clean_fraction <= 1.0:
        raise ValueError(f"clean_fraction must be in [0, 1], got {clean_fraction}")
    if num_demos < 1 or steps < 0 or batch_size < 1:
        raise ValueError(f"need num_demos >= 1, steps >= 0, batch_size >= 1 (got {num_demos}, {steps}, {batch_size})")

    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, dtype="float32")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    clean_demos: list[dict[str, Any]] = []
    demos: list[dict[str, Any]] = []
    for index, name in enumerate(names):
        count = num_demos // len(names) + (1 if index < num_demos % len(names) else 0)
        tasks = make_toy_tasks(name, count, seed=1000 + seed)
        demo_seed = seed * 7919 + index
        demos += make_noisy_demonstrations(name, tasks, tokenizer, noise, think_tokens_mean, seed=demo_seed,
                                           blind_fraction=blind_fraction)
        clean_demos += make_noisy_demonstrations(name, tasks, tokenizer, 0.0, think_tokens_mean, seed=demo_seed)
    clean_steps = int(round(clean_fraction * steps))
    phases = [(clean_demos, clean_steps), (demos, steps - clean_steps)]

    losses: list[float] = []
    with _torch_threads(num_threads), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _train(model, phases, pad_id, lr, batch_size, random.Random(seed), warmup_steps, log_every, losses)

    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_path)
    tokenizer.save_pretrained(out_path)
    tail = losses[-10:]
    stats = {
        "env_names": names,
        "out_dir": str(out_path),
        "num_demos": len(demos),
        "noise": noise,
        "steps": steps,
        "clean_steps": clean_steps,
        "lr": lr,
        "batch_size": batch_size,
        "seed": seed,
        "think_tokens_mean": think_tokens_mean,
        "blind_fraction": blind_fraction,
        "demo_success_rate": sum(d["success"] for d in demos) / len(demos),
        "mean_demo_tokens": sum(len(d["input_ids"]) for d in demos) / len(demos),
        "mean_assistant_tokens": sum(sum(d["loss_mask"]) for d in demos) / len(demos),
        "initial_loss": losses[0] if losses else None,
        "final_loss": sum(tail) / len(tail) if tail else None,
        "losses": losses,
        "seconds": time.monotonic() - started,
    }
    (out_path / "sft_stats.json").write_text(json.dumps(stats, indent=1))
    return stats


# --------------------------------------------------------------------------------------------------
# Measuring the warm start
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def _sample_turn(model, context: list[int], cache, stop_ids: set[int], max_new_tokens: int,
                 temperature: float, generator: torch.Generator):
    """Feed ``context`` (new tokens only) and sample until a stop id; returns (token ids, cache)."""
    out = model(input_ids=torch.tensor([context]), past_key_values=cache, use_cache=True)
    cache = out.past_key_values
    logits = out.logits[0, -1]
    generated: list[int] = []
    for _ in range(max_new_tokens):
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        else:
            token = int(torch.argmax(logits))
        generated.append(token)
        if token in stop_ids:
            break
        out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits = out.logits[0, -1]
    return generated, cache


def sample_success_rate(
    model,
    tokenizer,
    env_name: str,
    tasks: Sequence[dict[str, Any]],
    temperature: float = 1.0,
    max_new_tokens: int = 64,
    seed: int = 0,
    num_threads: int | None = 1,
) -> dict[str, Any]:
    """Play every task with the model (pure sampling at ``temperature``, no top-k/top-p) like the rollout.

    Context per episode: chat-template prompt ids, then per turn the sampled ids (up to and including
    ``<|im_end|>``), then the ids of ``observation_text(obs)``. A turn cut at ``max_new_tokens`` is still
    sent to the env as it is. Returns ``success_rate``, ``invalid_rate`` (turns), ``mean_turns``,
    ``mean_response_tokens`` (per turn), ``max_response_tokens``, ``num_tasks``.
    """
    names = _split_env_names(env_name)
    if len(names) != 1:
        raise ValueError("sample_success_rate measures one env at a time")
    name = names[0]
    stop_ids = {tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)}
    generator = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    successes = invalid = turns_total = 0
    response_lengths: list[int] = []
    with _torch_threads(num_threads):
        for task in tasks:
            env = ToyKeysEnv() if name == "toy_keys" else ToyEchoEnv()
            prompt = env.reset(task)
            context = _encode(tokenizer, _render(tokenizer, [{"role": "user", "content": prompt}], True))
            cache = None
            result = None
            for _ in range(env.max_turns):
                generated, cache = _sample_turn(model, context, cache, stop_ids, max_new_tokens, temperature, generator)
                response_lengths.append(len(generated))
                text = tokenizer.decode([t for t in generated if t not in stop_ids], skip_special_tokens=False)
                result = env.step(text)
                turns_total += 1
                invalid += bool(result.info.get("invalid_action"))
                if result.done:
                    break
                context = ([] if generated and generated[-1] in stop_ids else _encode(tokenizer, IM_END))
                context += _encode(tokenizer, observation_text(result.observation))
            successes += bool(result is not None and result.info.get("success"))
    model.train(was_training)
    n = max(1, len(tasks))
    return {
        "env": name,
        "num_tasks": len(tasks),
        "temperature": temperature,
        "success_rate": successes / n,
        "invalid_rate": invalid / max(1, turns_total),
        "mean_turns": turns_total / n,
        "mean_response_tokens": sum(response_lengths) / max(1, len(response_lengths)),
        "max_response_tokens": max(response_lengths, default=0),
    }


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m async_rl.models.sft",
        description="SFT warm start of a (tiny) model on noisy toy-task demonstrations.",
    )
    parser.add_argument("--model", required=True, help="input model directory")
    parser.add_argument("--out", required=True, help="output directory (model + tokenizer + sft_stats.json)")
    parser.add_argument("--env", default="toy_keys", help="toy_keys, toy_echo, or both comma-separated")
    parser.add_argument("--num-demos", type=int, default=DEFAULT_NUM_DEMOS)
    parser.add_argument("--noise", type=float, default=None, help="fraction of wrong demos (default per env)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default per env)")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR)
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument("--think-tokens-mean", type=float, default=DEFAULT_THINK_TOKENS_MEAN)
    parser.add_argument("--clean-fraction", type=float, default=None,
                        help="fraction of the steps (the first ones) on clean demos (default per env)")
    parser.add_argument("--blind-fraction", type=float, default=None,
                        help="toy_keys: fraction of the wrong demos that skip `look` (default per env)")
    parser.add_argument("--num-threads", type=int, default=1, help="torch CPU threads (0: leave torch's setting)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=0)
    parser.add_argument("--eval-tasks", type=int, default=0, help="if > 0, sample this many fresh tasks per env")
    parser.add_argument("--eval-seed", type=int, default=12345)
    parser.add_argument("--temperature", type=float, default=1.0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    stats = sft_warm_start(
        args.model,
        args.out,
        env_name=args.env,
        num_demos=args.num_demos,
        noise=args.noise,
        steps=args.steps,
        lr=args.lr,
        batch_size=args.batch_size,
        seed=args.seed,
        think_tokens_mean=args.think_tokens_mean,
        clean_fraction=args.clean_fraction,
        blind_fraction=args.blind_fraction,
        log_every=args.log_every,
        num_threads=args.num_threads or None,
    )
    report = {k: v for k, v in stats.items() if k != "losses"}
    if args.eval_tasks > 0:
        from async_rl.models.loading import load_causal_lm, load_tokenizer

        model, tokenizer = load_causal_lm(args.out), load_tokenizer(args.out)
        report["eval"] = [
            sample_success_rate(
                model, tokenizer, name, make_toy_tasks(name, args.eval_tasks, seed=args.eval_seed),
                temperature=args.temperature, seed=args.eval_seed, num_threads=args.num_threads or None,
            )
            for name in stats["env_names"]
        ]
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()


# --------------------------------------------------------------------------------------------------
# Warm starts on the real tasks (the SIZE=tiny recipes: math, retool, alfworld, webshop)
# --------------------------------------------------------------------------------------------------

#: Tuned so each SIZE=tiny recipe's tiny model knows its task's action format and succeeds sometimes
#: (recipes/README.md). Multi-turn transcripts (2-3k tokens) train one at a time: a padded batch costs twice
#: as much per token on CPU (the attention mask disables the fused causal kernel).
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "math": {"noise": 0.6, "steps": 200, "clean_fraction": 0.5, "num_demos": 256, "batch_size": 16},
    "retool": {"noise": 0.6, "steps": 250, "clean_fraction": 0.6, "num_demos": 128, "batch_size": 16},
    # a game is lost by any wrong action among five: fewer noisy demos than the single-turn tasks
    "alfworld": {"noise": 0.3, "steps": 200, "clean_fraction": 0.6, "num_demos": 24, "batch_size": 1},
    # product ids are 10 random characters to copy from the page: more steps than the others
    "webshop": {"noise": 0.3, "steps": 500, "clean_fraction": 0.7, "num_demos": 32, "batch_size": 1},
}
TASK_DEMO_ENVS: tuple[str, ...] = tuple(TASK_DEFAULTS)
# no thinking fillers: a tiny model sampling at temperature 1 garbles actions that follow random filler words,
# and the multi-turn recipes' token budgets are tight (the envs parse only the <action> tag)
TASK_THINK_TOKENS_MEAN = 0.0

_INTERPRETER_INT = re.compile(r"<interpreter>\s*(-?\d+)\s*</interpreter>")


def _wrong_number(rng: random.Random, right: str) -> str:
    """A plausible wrong integer answer: the right one with one digit changed (or off by one)."""
    if right.lstrip("-").isdigit():
        digits = list(right)
        positions = [i for i, ch in enumerate(digits) if ch.isdigit()]
        i = rng.choice(positions)
        digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
        wrong = "".join(digits)
        return wrong if wrong != right else str(int(right) + 1)
    return str(rng.randrange(1000))


def _perturbed_expression(rng: random.Random, expression: str) -> str:
    """``expression`` with one digit changed: code that runs, but computes the wrong number."""
    positions = [i for i, ch in enumerate(expression) if ch.isdigit()]
    if not positions:
        return expression + "+1"
    i = rng.choice(positions)
    return expression[:i] + rng.choice([d for d in "123456789" if d != expression[i]]) + expression[i + 1:]


def _retool_code(expression: str) -> str:
    return f"<code>\nprint({expression})\n</code>"


def _names_phrase(text: str, phrase: str) -> bool:
    """``phrase`` occurs in ``text`` as whole words ("8 fl oz" is not named by "33.8 fl oz", "large" not by
    "x-large")."""
    return re.search(r"(?<![\w.-])" + re.escape(phrase) + r"(?![\w.-])", text) is not None


class _ScriptedPolicy:
    """One scripted demonstration episode of a real task: the next action given what the env showed.

    Clean episodes play the task's expert: math boxes the training record's answer; ReTool runs the
    toy expression (or prints the record's answer) in ``<code>`` and then boxes the interpreter's
    number; ALFWorld follows the PDDL planner (``AlfWorldEnv(expert=True).expert_plan``); WebShop searches
    the goal's product query (the simulator's catalog; the instruction on a server), opens the target
    product when it is listed (else the first result), clicks the
    option values the instruction names and buys. A noisy episode makes one mistake at a turn drawn at
    random: a wrong number, code with a wrong digit, a random admissible action, a random product or
    buying without choosing options, so that the demonstrations succeed only sometimes.
    """

    def __init__(self, env_name: str, env, task: dict[str, Any], noisy: bool, rng: random.Random):
        self.env_name, self.env, self.task, self.noisy, self.rng = env_name, env, task, noisy, rng
        self.turn = 0
        self.clicked_options: set[str] = set()  # WebShop option values chosen on the product page
        # turns where a mistake changes the outcome (WebShop's first turn is always the search)
        first, stop = {"math": (0, 1), "retool": (0, 2), "alfworld": (0, 4), "webshop": (1, 3)}[env_name]
        self.mistake_turn = rng.randrange(first, stop) if noisy else -1

    def act(self, observation: str) -> str:
        wrong = self.turn == self.mistake_turn
        action = getattr(self, f"_{self.env_name}")(observation, wrong)
        self.turn += 1
        return action

    def _math(self, observation: str, wrong: bool) -> str:
        answer = str(self.task["answer"]).strip()
        return f"\\boxed{{{_wrong_number(self.rng, answer) if wrong else answer}}}"

    def _retool(self, observation: str, wrong: bool) -> str:
        if self.turn == 0:
            expression = str(self.task.get("expression") or str(self.task["answer"]).strip())
            if wrong and self.rng.random() < 0.5:  # answer without the tool, from "mental arithmetic"
                return f"\\boxed{{{_wrong_number(self.rng, str(self.task['answer']).strip())}}}"
            return _retool_code(_perturbed_expression(self.rng, expression) if wrong else expression)
        match = _INTERPRETER_INT.search(observation)
        value = match.group(1) if match else _wrong_number(self.rng, str(self.task["answer"]).strip())
        return f"The result is \\boxed{{{_wrong_number(self.rng, value) if wrong else value}}}."

    def _alfworld(self, observation: str, wrong: bool) -> str:
        plan = self.env.expert_plan
        choice = plan[0] if plan else "look"
        if wrong:
            others = [a for a in self.env.admissible_actions if a != choice]
            choice = self.rng.choice(others) if others else choice
        return f"<action>{choice}</action>"

    def _webshop(self, observation: str, wrong: bool) -> str:
        actions = self.env.admissible_actions
        clicks = [a[len("click["):-1] for a in actions if a.startswith("click[")]
        if any(a.startswith("search[") for a in actions):
            # the goal's short product query ("sunglasses"), as a shopper types it: a tiny model cannot copy
            # a whole instruction, and one query per product type gives a results page it can learn
            goal = self.env.simulator_goal(int(self.task["goal_index"])) if hasattr(self.env, "simulator_goal") else None
            return f"<action>search[{(goal or {}).get('query') or self.env.instruction}]</action>"
        if "buy now" in clicks:  # a product page: choose the options the instruction names, then buy
            instruction = (self.env.instruction or "").lower()
            navigation = {"back to search", "< prev", "description", "features", "reviews", "buy now"}
            for value in clicks:
                if (value not in navigation and value not in self.clicked_options and not wrong
                        and _names_phrase(instruction, value)):
                    self.clicked_options.add(value)
                    return f"<action>click[{value}]</action>"
            return "<action>click[buy now]</action>"
        products = [c for c in clicks if re.fullmatch(r"b0[a-z0-9]{8}", c)]
        target = str(self.task.get("target_asin") or "").lower()
        if wrong and products:
            return f"<action>click[{self.rng.choice(products)}]</action>"
        if target in products:
            return f"<action>click[{target}]</action>"
        return f"<action>click[{products[0] if products else 'back to search'}]</action>"


def make_task_demonstrations(
    env_name: str,
    env,
    tasks: Sequence[dict[str, Any]],
    tokenizer,
    num_demos: int,
    noise: float,
    think_tokens_mean: float = TASK_THINK_TOKENS_MEAN,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """``num_demos`` scripted episodes of a real task (:class:`_ScriptedPolicy`), played through ``env``.

    Demonstration ``i`` plays ``tasks[i % len(tasks)]``, so pass *training* records only: the demos use
    their answers. Each episode is noisy with probability ``noise``. Fields as in
    :func:`make_noisy_demonstrations`; ``num_code_turns`` counts the ReTool code runs.
    """
    if env_name not in TASK_DEMO_ENVS:
        raise ValueError(f"no scripted demonstrations for env {env_name!r}; valid: {TASK_DEMO_ENVS}")
    if not tasks:
        raise ValueError(f"env {env_name!r}: no training tasks to build demonstrations from")
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise must be in [0, 1], got {noise}")
    rng = random.Random(seed)
    demos: list[dict[str, Any]] = []
    for i in range(num_demos):
        task = tasks[i % len(tasks)]
        noisy = rng.random() < noise
        policy = _ScriptedPolicy(env_name, env, task, noisy, rng)
        messages = [{"role": "user", "content": env.reset(task)}]
        observation, result, code_turns = messages[0]["content"], None, 0
        for _ in range(int(getattr(env, "max_turns", 1) or 1)):
            action = policy.act(observation)
            text = think_filler(rng, think_tokens_mean) + action if env_name in ("alfworld", "webshop") else action
            messages.append({"role": "assistant", "content": text})
            result = env.step(text)
            code_turns += bool(result.info.get("tool_executed"))
            if result.done:
                break
            observation = result.observation
            messages.append({"role": "user", "content": observation})
        if messages[-1]["role"] == "user":
            messages.pop()  # out of turns without a final message: the last observation carries no loss
        demo = {"id": task.get("id"), "env": env_name, "messages": messages, "noisy": noisy,
                "reward": float(result.reward) if result is not None else 0.0,
                "success": bool(result is not None and result.info.get("success", False)),
                "num_code_turns": code_turns}
        demo.update(tokenize_conversation(messages, tokenizer))
        demos.append(demo)
    return demos


def sft_warm_start_on_tasks(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    env_name: str,
    tasks: Sequence[dict[str, Any]],
    env_kwargs: dict[str, Any] | None = None,
    num_demos: int | None = None,
    noise: float | None = None,
    steps: int | None = None,
    lr: float = DEFAULT_LR,
    batch_size: int | None = None,
    seed: int = 0,
    clean_fraction: float | None = None,
    warmup_steps: int = 20,
    log_every: int = 0,
    num_threads: int | None = 1,
) -> dict[str, Any]:
    """Warm start on scripted demonstrations of a real task, the same two-phase SFT as :func:`sft_warm_start`.

    ``tasks`` are the run's *training* records (never an eval split: the demos use their answers);
    ``env_kwargs`` build the env exactly as the run does (plus ``expert=True`` for ALFWorld's planner).
    The first ``clean_fraction`` of the steps train on clean versions of the demonstrations, the rest on
    the noisy ones. None takes :data:`TASK_DEFAULTS`. Writes the model, tokenizer and ``sft_stats.json``
    (which adds ``demo_reward_mean`` and, for ReTool, ``demo_code_turns_mean``) to ``out_dir``.
    """
    from async_rl.envs.base import make_env
    from async_rl.models.loading import load_causal_lm, load_tokenizer

    if env_name not in TASK_DEMO_ENVS:
        raise ValueError(f"model.sft: no demonstrations for env {env_name!r}; valid: "
                         f"{', '.join(TOY_ENV_NAMES + TASK_DEMO_ENVS)} (or set model.sft.enabled=false)")
    defaults = TASK_DEFAULTS[env_name]
    noise = defaults["noise"] if noise is None else noise
    steps = defaults["steps"] if steps is None else steps
    num_demos = defaults["num_demos"] if num_demos is None else num_demos
    batch_size = defaults["batch_size"] if batch_size is None else batch_size
    clean_fraction = defaults["clean_fraction"] if clean_fraction is None else clean_fraction
    if not 0.0 <= clean_fraction <= 1.0:
        raise ValueError(f"clean_fraction must be in [0, 1], got {clean_fraction}")
    if num_demos < 1 or steps < 0 or batch_size < 1:
        raise ValueError(f"need num_demos >= 1, steps >= 0, batch_size >= 1 (got {num_demos}, {steps}, {batch_size})")
    started = time.monotonic()
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, dtype="float32")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    kwargs = dict(env_kwargs or {})
    if env_name == "alfworld":
        kwargs["expert"] = True
    env = make_env(env_name, **kwargs)
    try:
        demos = make_task_demonstrations(env_name, env, tasks, tokenizer, num_demos, noise, seed=seed * 7919)
        # clean episodes of a task differ only in their thinking fillers: two per task are enough
        clean_demos = make_task_demonstrations(env_name, env, tasks, tokenizer,
                                               min(num_demos, max(4, 2 * len(tasks))), 0.0, seed=seed * 7919 + 1)
    finally:
        env.close()
    clean_steps = int(round(clean_fraction * steps))
    losses: list[float] = []
    with _torch_threads(num_threads), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _train(model, [(clean_demos, clean_steps), (demos, steps - clean_steps)], pad_id, lr, batch_size,
               random.Random(seed), warmup_steps, log_every, losses)
    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_path)
    tokenizer.save_pretrained(out_path)
    tail = losses[-10:]
    stats = {
        "env_names": [env_name], "out_dir": str(out_path), "num_demos": len(demos), "noise": noise,
        "steps": steps, "clean_steps": clean_steps, "lr": lr, "batch_size": batch_size, "seed": seed,
        "demo_success_rate": sum(d["success"] for d in demos) / len(demos),
        "demo_reward_mean": sum(d["reward"] for d in demos) / len(demos),
        "demo_code_turns_mean": sum(d["num_code_turns"] for d in demos) / len(demos),
        "mean_demo_tokens": sum(len(d["input_ids"]) for d in demos) / len(demos),
        "max_demo_tokens": max(len(d["input_ids"]) for d in demos),
        "mean_assistant_tokens": sum(sum(d["loss_mask"]) for d in demos) / len(demos),
        "initial_loss": losses[0] if losses else None,
        "final_loss": sum(tail) / len(tail) if tail else None,
        "losses": losses,
        "seconds": time.monotonic() - started,
    }
    (out_path / "sft_stats.json").write_text(json.dumps(stats, indent=1))
    return stats
