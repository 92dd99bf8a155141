"""Supervised warm start on noisy demonstrations: the toy tasks (``toy_keys`` / ``toy_echo``) and, for the
SIZE=tiny recipes, scripted episodes of the real tasks (math, retool, alfworld, webshop).

:func:`sft_warm_start` turns a random tiny model into a weak policy (it knows the format and sometimes
succeeds): assistant-only SFT on chat-rendered demonstrations, clean first, then with a fraction ``noise``
wrong. Demonstrations are tokenised exactly as the multi-turn rollout builds its context.
:func:`sft_warm_start_on_tasks` serves the real tasks; :func:`sample_success_rate` measures the result.

CLI::

    python -m async_rl.models.sft --model DIR --out DIR --env toy_keys [--noise 0.7 --steps 450 ...]
        [--eval-tasks 100]   # also sample the result at temperature 1 and print its success rate

Details: docs/toy_tasks.md (SFT warm start; Chat layout); recipes/README.md (the real tasks).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from async_rl.envs.base import make_env
from async_rl.envs.facts import Demonstrations, demonstration_env_names, env_facts
from async_rl.envs.toy import make_toy_tasks, observation_text  # (importing async_rl.envs registers every env)
from async_rl.validation import parse_settings, setting

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
#: ``on_step(step, steps, loss)``: called after every optimizer step (1-based ``step`` of ``steps``)
OnStep = Callable[[int, int, float], None]
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"


def _demonstrations(name: str, toy: bool) -> Demonstrations:
    """The env's registered scripted demonstrations (``envs/demonstrations.py``), of the kind asked for."""
    demos = env_facts(name).demonstrations if name in demonstration_env_names(toy) else None
    if demos is None:
        kind = "toy" if toy else "task"
        raise ValueError(f"no scripted demonstrations for env {name!r} here; {kind} envs with them: "
                         f"{', '.join(demonstration_env_names(toy))}")
    return demos


# The built-in envs' warm-start defaults, registered with their demonstrations (envs/demonstrations.py):
# toy ones chosen so the default tiny model lands in the target success band (docs/toy_tasks.md)
DEFAULTS: dict[str, dict[str, Any]] = {
    name: dict(_demonstrations(name, toy=True).sft_defaults) for name in demonstration_env_names(toy=True)}
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
        try:
            scripted = _demonstrations(str(name), toy=True)
        except ValueError as error:
            raise ValueError(f"task {task.get('id', '?')!r}: {error}") from None
        noisy = rng.random() < noise
        env = make_env(name)
        act = scripted.policy(env, task, noisy, rng, blind_fraction=blind_fraction)
        messages, result, _ = _play(env, task, act, rng, think_tokens_mean if scripted.think_fillers else 0.0)
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


def _train(model, phases, pad_id, lr, batch_size, rng, warmup_steps, log_every, losses, on_step=None) -> None:
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
        if on_step is not None:
            on_step(step + 1, steps, losses[-1])
    model.eval()


def _split_env_names(env_name: str | Sequence[str]) -> list[str]:
    names = [n.strip() for n in env_name.split(",")] if isinstance(env_name, str) else [str(n) for n in env_name]
    names = [n for n in names if n]
    valid = demonstration_env_names(toy=True)
    if not names or any(n not in valid for n in names):
        raise ValueError(f"env_name must name toy envs from {tuple(valid)}, got {env_name!r}")
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
    on_step: OnStep | None = None,
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
        on_step: called after every optimizer step with ``(step, steps, loss)`` (the trainer's progress display).
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
        blind_fraction = next((float(DEFAULTS[n]["blind_fraction"]) for n in names if "blind_fraction" in DEFAULTS[n]),
                              DEFAULTS["toy_keys"]["blind_fraction"])
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
        _train(model, phases, pad_id, lr, batch_size, random.Random(seed), warmup_steps, log_every, losses, on_step)

    return _save_warm_start(model, tokenizer, out_dir, demos, losses, started, {
        "env_names": names, "num_demos": len(demos), "noise": noise, "steps": steps, "clean_steps": clean_steps,
        "lr": lr, "batch_size": batch_size, "seed": seed, "think_tokens_mean": think_tokens_mean,
        "blind_fraction": blind_fraction})


def _save_warm_start(model, tokenizer, out_dir, demos: list[dict[str, Any]], losses: list[float], started: float,
                     settings: dict[str, Any]) -> dict[str, Any]:
    """Saves the model and tokenizer to ``out_dir`` and returns its stats (also written as ``sft_stats.json``):
    ``settings``, then the demonstrations' and the loss curve's summaries."""
    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_path)
    tokenizer.save_pretrained(out_path)
    tail = losses[-10:]
    stats = {
        **settings,
        "out_dir": str(out_path),
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
            env = make_env(name)
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


@dataclass
class SFTOptions:
    """``python -m async_rl.models.sft`` options: each a setting (type, default, range, meaning), read by
    :func:`async_rl.validation.parse_settings`."""

    model: str = setting(meaning="input model directory", non_empty=True)
    out: str = setting(meaning="output directory (model + tokenizer + sft_stats.json)", non_empty=True)
    env: str = setting("toy_keys", "toy_keys, toy_echo, or both comma-separated", non_empty=True)
    num_demos: int = setting(DEFAULT_NUM_DEMOS, "scripted demonstrations generated", range=">= 1")
    noise: Optional[float] = setting(None, "fraction of wrong demos (null: the env's default)", range="[0, 1]")
    steps: Optional[int] = setting(None, "optimizer steps (null: the env's default)", range=">= 1")
    lr: float = setting(DEFAULT_LR, "learning rate (the tiny model's; a pretrained model needs ~1e-5)", range="> 0")
    batch_size: int = setting(DEFAULT_BATCH_SIZE, "demonstrations per optimizer step", range=">= 1")
    think_tokens_mean: float = setting(DEFAULT_THINK_TOKENS_MEAN, "mean length of a <think> filler", range=">= 0")
    clean_fraction: Optional[float] = setting(None, "fraction of the steps (the first ones) on clean demos (null: the "
                                                    "env's default)", range="[0, 1]")
    blind_fraction: Optional[float] = setting(None, "toy_keys: fraction of the wrong demos that skip `look` (null: "
                                                    "the env's default)", range="[0, 1]")
    num_threads: int = setting(1, "torch CPU threads (0: leave torch's setting)", range=">= 0")
    seed: int = setting(0, "seed of the demonstrations and the optimizer", range=">= 0")
    log_every: int = setting(0, "print the loss every this many steps (0: never)", range=">= 0")
    eval_tasks: int = setting(0, "if > 0, sample this many fresh tasks per env after training", range=">= 0")
    eval_seed: int = setting(12345, "seed of the evaluation tasks and samples", range=">= 0")
    temperature: float = setting(1.0, "sampling temperature of the evaluation", range="> 0")


def _parse_args(argv: list[str] | None = None) -> SFTOptions:
    return parse_settings(SFTOptions, argv, "SFT warm start of a (tiny) model on noisy toy-task demonstrations.",
                          prog="python -m async_rl.models.sft")


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

#: The real tasks' warm-start defaults, registered with their demonstrations (envs/demonstrations.py), tuned so
#: each SIZE=tiny recipe's tiny model knows its task's action format and succeeds sometimes (recipes/README.md).
TASK_DEMO_ENVS: tuple[str, ...] = tuple(demonstration_env_names(toy=False))
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    name: dict(_demonstrations(name, toy=False).sft_defaults) for name in TASK_DEMO_ENVS}
# no thinking fillers: a tiny model sampling at temperature 1 garbles actions that follow random filler words,
# and the multi-turn recipes' token budgets are tight (the envs parse only the <action> tag)
TASK_THINK_TOKENS_MEAN = 0.0


def _play(env, task: dict[str, Any], act, rng: random.Random, think_tokens_mean: float):
    """One scripted episode through ``env``: (messages, last StepResult, number of tool runs).

    The user turns carry the env's observations verbatim; a run out of turns drops its last observation
    (it carries no loss)."""
    messages = [{"role": "user", "content": env.reset(task)}]
    observation, result, tool_runs = messages[0]["content"], None, 0
    for _ in range(int(getattr(env, "max_turns", 1) or 1)):
        text = act(observation)
        text = think_filler(rng, think_tokens_mean) + text
        messages.append({"role": "assistant", "content": text})
        result = env.step(text)
        tool_runs += bool(result.info.get("tool_executed"))
        if result.done:
            break
        observation = result.observation
        messages.append({"role": "user", "content": observation})
    if messages[-1]["role"] == "user":
        messages.pop()
    return messages, result, tool_runs


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
    """``num_demos`` scripted episodes of a real task (its registered policy), played through ``env``.

    Demonstration ``i`` plays ``tasks[i % len(tasks)]``, so pass *training* records only: the demos use
    their answers. Each episode is noisy with probability ``noise``. Fields as in
    :func:`make_noisy_demonstrations`; ``num_code_turns`` counts the ReTool code runs.
    """
    scripted = _demonstrations(env_name, toy=False)
    if not tasks:
        raise ValueError(f"env {env_name!r}: no training tasks to build demonstrations from")
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise must be in [0, 1], got {noise}")
    rng = random.Random(seed)
    demos: list[dict[str, Any]] = []
    for i in range(num_demos):
        task = tasks[i % len(tasks)]
        noisy = rng.random() < noise
        act = scripted.policy(env, task, noisy, rng)
        messages, result, code_turns = _play(env, task, act, rng,
                                             think_tokens_mean if scripted.think_fillers else 0.0)
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
    on_step: OnStep | None = None,
) -> dict[str, Any]:
    """Warm start on scripted demonstrations of a real task, the same two-phase SFT as :func:`sft_warm_start`.

    ``tasks`` are the run's *training* records (never an eval split: the demos use their answers);
    ``env_kwargs`` build the env exactly as the run does (plus ``expert=True`` for ALFWorld's planner).
    The first ``clean_fraction`` of the steps train on clean versions of the demonstrations, the rest on
    the noisy ones. None takes :data:`TASK_DEFAULTS`. Writes the model, tokenizer and ``sft_stats.json``
    (which adds ``demo_reward_mean`` and, for ReTool, ``demo_code_turns_mean``) to ``out_dir``. ``on_step``: as
    in :func:`sft_warm_start`.
    """
    from async_rl.models.loading import load_causal_lm, load_tokenizer

    if env_name not in demonstration_env_names(toy=False):
        raise ValueError(f"model.sft: no demonstrations for env {env_name!r}; valid: "
                         f"{', '.join(demonstration_env_names(toy=True) + demonstration_env_names(toy=False))} "
                         "(or set model.sft.enabled=false)")
    scripted = _demonstrations(env_name, toy=False)
    defaults = scripted.sft_defaults
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
    kwargs = {**(env_kwargs or {}), **scripted.env_kwargs}  # e.g. ALFWorld's planner for the expert
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
               random.Random(seed), warmup_steps, log_every, losses, on_step)
    return _save_warm_start(model, tokenizer, out_dir, demos, losses, started, {
        "env_names": [env_name], "num_demos": len(demos), "noise": noise, "steps": steps, "clean_steps": clean_steps,
        "lr": lr, "batch_size": batch_size, "seed": seed,
        "demo_reward_mean": sum(d["reward"] for d in demos) / len(demos),
        "demo_code_turns_mean": sum(d["num_code_turns"] for d in demos) / len(demos),
        "max_demo_tokens": max(len(d["input_ids"]) for d in demos)})
