"""Framework overhead: the project's synchronous arm vs a minimal hand-written GRPO loop doing the same work.

Both sides: the SFT-warm-started tiny model of ``_training.warm_model`` (same weights), toy_keys, GRPO with B = 32
trajectories per step (8 prompts x n = 4), up to 4 turns of at most 24 sampled tokens, 160 response tokens,
temperature 1, lr 1e-3 AdamW (no weight decay), gradient clipping at 1, one torch thread, ``--steps`` steps.

- **project**: exactly the ``sync`` arm of ``async_vs_sync.py`` -- ``_training.run_algorithm("grpo", ...,
  driver_overrides={"synchronous": True})``: the deterministic driver, the rollout engine (continuous
  batching, KV cache, per-token versions), env calls on the worker pool under timeouts, episodes, buffer,
  learner, verl's registered loss, weight publication to the rollout engine's own copy of the model.
- **minimal**: the loop below, written for this benchmark and importing nothing of the project but the model /
  tokenizer loaders and the toy task (its data and its env class, called inline: no timeouts, no pool). One
  model for sampling and training; turn by turn, every live episode is prefilled and decoded together with a
  KV cache until all of them stopped, then every env steps; ``torch.multinomial`` sampling; the clipped GRPO
  loss written out. (A variant that played all turns in one batch, feeding observations token by token so
  that no row waits for the others' turns, was 1.3x slower still: it needs more forward passes.)

Where the time goes: both sides are instrumented the same way -- time and count of the model's forward
passes (``Qwen2ForCausalLM.forward``, sampling and training), of ``Tensor.backward`` and of the AdamW steps.
``compute`` is their sum; ``other`` = wall - compute is everything else (scheduling, env calls, sampling
arithmetic, tokenisation, bookkeeping, metrics). The minimal loop runs more forward passes (a turn waits for
its slowest row; the project's continuous batching starts a row's next turn while others still generate),
so the wall ratio mixes the two schedules; ``other`` compares the overheads directly.

The two sample different tokens (different random streams), so each reports how many tokens and
trajectories it generated; the ratio of wall times is quoted next to the ratio of tokens. Runs alternate
(project, minimal, project, ...) ``--repeats`` times so machine load hits both alike; medians are reported.
Wall time is the training loop only (model loading excluded), split into generation and training.

Run: ``.venv/bin/python benchmarks/framework_overhead.py [--quick]``; writes results/framework_overhead.json
(``--quick``: framework_overhead_quick.json, 1 repeat of 4 steps).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time

import torch

import _common as C
import _training as T

B, N = 32, 4  # trajectories per step, group size: the async_vs_sync sync arm
MAX_TURNS, MAX_NEW_TOKENS, MAX_RESPONSE_TOKENS = 4, 24, 160
LR, MAX_GRAD_NORM, GRPO_EPS = 1e-3, 1.0, 1e-6
CLIP_LOW, CLIP_HIGH, DUAL_CLIP = 0.2, 0.28, 3.0  # verl's "vanilla" loss, as the project's GRPO preset uses
TARGET_RATIO = 1.25


# --------------------------------------------------------------------------------------------------------------
# where the time goes (the same instrumentation on both sides)
# --------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def compute_timer():
    """Time and count the backbone's forward passes, ``Tensor.backward`` and ``AdamW.step`` while active.

    Patched at class level, so the project's models (rollout engine and actor) and the minimal loop's model
    are measured alike. Nested calls (the backbone inside a checkpoint recompute inside backward) count once.
    Yields a dict filled on exit: ``forward_s``, ``forwards``, ``backward_s``, ``optimizer_s``.
    """
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Model

    totals = {"forward_s": 0.0, "forwards": 0, "backward_s": 0.0, "optimizer_s": 0.0}
    depth = [0]

    def timed(original, seconds_key, count_key=None):
        def wrapper(*args, **kwargs):
            if depth[0]:
                return original(*args, **kwargs)
            depth[0] += 1
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                totals[seconds_key] += time.perf_counter() - started
                if count_key:
                    totals[count_key] += 1
                depth[0] -= 1
        return wrapper

    patched = [(Qwen2Model, "forward", "forward_s", "forwards"), (torch.Tensor, "backward", "backward_s", None),
               (torch.optim.AdamW, "step", "optimizer_s", None)]
    # (AdamW may inherit its step from Adam: then the patch is removed again rather than "restored")
    originals = [(owner, name, owner.__dict__.get(name)) for owner, name, _, _ in patched]
    for owner, name, seconds_key, count_key in patched:
        setattr(owner, name, timed(getattr(owner, name), seconds_key, count_key))
    try:
        yield totals
    finally:
        for owner, name, original in originals:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def with_breakdown(result: dict, totals: dict) -> dict:
    compute = totals["forward_s"] + totals["backward_s"] + totals["optimizer_s"]
    return {**result, **totals, "compute_s": compute, "other_s": result["wall_s"] - compute}


# --------------------------------------------------------------------------------------------------------------
# the minimal reference loop
# --------------------------------------------------------------------------------------------------------------
@torch.inference_mode()
def sample_turn(model, contexts, budgets, stop_ids, pad_id, generator):
    """Sample one turn for every context together: left-padded prefill, then KV-cached decoding until every
    row hit a stop token or its budget. Returns ``[(token_ids, logprobs)]`` per row."""
    rows, width = len(contexts), max(len(c) for c in contexts)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for r, context in enumerate(contexts):
        ids[r, width - len(context):] = torch.tensor(context)
        mask[r, width - len(context):] = 1
    out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                use_cache=True, logits_to_keep=1)
    positions = mask.sum(-1)
    tokens: list[list[int]] = [[] for _ in range(rows)]
    logprobs: list[list[float]] = [[] for _ in range(rows)]
    live = set(range(rows))
    for _ in range(max(budgets)):
        logp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)  # (rows, V), temperature 1
        sampled = torch.multinomial(logp.exp(), 1, generator=generator)  # (rows, 1)
        picked = logp.gather(1, sampled).squeeze(1).tolist()
        for r, token in enumerate(sampled.squeeze(1).tolist()):
            if r in live:
                tokens[r].append(token)
                logprobs[r].append(picked[r])
                if token in stop_ids or len(tokens[r]) >= budgets[r]:
                    live.discard(r)
        if not live:
            break
        mask = torch.cat([mask, torch.ones((rows, 1), dtype=torch.long)], dim=1)
        out = model(input_ids=sampled, attention_mask=mask, position_ids=positions[:, None],
                    past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
        positions = positions + 1
    return list(zip(tokens, logprobs))


def play_turns(model, tokenizer, episodes, stop_ids, im_end, pad_id, generator) -> int:
    """Turn by turn: all live episodes sample a turn together, then every env steps. Returns tokens sampled."""
    sampled_tokens = 0
    for turn in range(MAX_TURNS):
        live = [e for e in episodes if not e["done"]]
        if not live:
            break
        budgets = [min(MAX_NEW_TOKENS, MAX_RESPONSE_TOKENS - len(e["response"])) for e in live]
        turns = sample_turn(model, [e["prompt"] + e["response"] for e in live], budgets, stop_ids, pad_id,
                            generator)
        for e, (new_tokens, new_logprobs) in zip(live, turns):
            sampled_tokens += len(new_tokens)
            e["response"] += new_tokens
            e["model_mask"] += [1] * len(new_tokens)
            e["logprobs"] += new_logprobs
            result = e["env"].step(tokenizer.decode(new_tokens, skip_special_tokens=True))
            e["reward"] += result.reward
            if result.done or turn == MAX_TURNS - 1:
                e["done"], e["success"] = True, bool(result.info.get("success"))
                continue
            prefix = "\n" if new_tokens[-1:] == [im_end] else "<|im_end|>\n"
            observation = tokenizer(f"{prefix}<|im_start|>user\n{result.observation}<|im_end|>\n"
                                    "<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
            if len(e["response"]) + len(observation) >= MAX_RESPONSE_TOKENS:
                e["done"] = True
                continue
            e["response"] += observation
            e["model_mask"] += [0] * len(observation)
            e["logprobs"] += [0.0] * len(observation)
    return sampled_tokens


def grpo_update(model, optimizer, episodes, pad_id):
    """One GRPO step: group-normalised rewards, clipped ratio against the sampling log-probs, seq-mean-token-mean."""
    P = max(len(e["prompt"]) for e in episodes)
    T = max(max(len(e["response"]) for e in episodes), 1)
    bs = len(episodes)
    ids = torch.full((bs, P + T), pad_id, dtype=torch.long)
    attention = torch.zeros((bs, P + T), dtype=torch.long)
    loss_mask = torch.zeros((bs, T))
    old_logp = torch.zeros((bs, T))
    for i, e in enumerate(episodes):
        p, n = len(e["prompt"]), len(e["response"])
        ids[i, P - p:P] = torch.tensor(e["prompt"])
        attention[i, P - p:P] = 1
        if n:
            ids[i, P:P + n] = torch.tensor(e["response"])
            attention[i, P:P + n] = 1
            loss_mask[i, :n] = torch.tensor(e["model_mask"], dtype=torch.float32)
            old_logp[i, :n] = torch.tensor(e["logprobs"])
    rewards = torch.tensor([e["reward"] for e in episodes]).view(-1, N)  # (prompts, N): groups are contiguous
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + GRPO_EPS)).view(-1, 1)
    model.train()
    logits = model(input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
                   use_cache=False, logits_to_keep=T + 1).logits[:, :-1]  # (bs, T, V): column j predicts token P+j
    logp = torch.log_softmax(logits.float(), dim=-1).gather(2, ids[:, P:, None]).squeeze(2)
    ratio = torch.exp(logp - old_logp)
    clipped = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
    per_token = torch.where(advantages < 0, torch.minimum(clipped, -advantages * DUAL_CLIP), clipped)
    per_seq = (per_token * loss_mask).sum(1) / loss_mask.sum(1).clamp(min=1)
    loss = per_seq.mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    model.eval()


def run_minimal(model_path: str, steps: int, seed: int) -> dict:
    from async_rl.envs.toy import ToyKeysEnv, make_toy_tasks
    from async_rl.models.loading import load_causal_lm, load_tokenizer

    C.set_threads()
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(model_path)
    model = load_causal_lm(model_path).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    stop_ids = {im_end, tokenizer.eos_token_id}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    tasks = make_toy_tasks("toy_keys", 256, seed)
    order = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    with compute_timer() as totals:
        started = time.perf_counter()
        parts = _minimal_steps(steps, model, tokenizer, optimizer, tasks, order, generator, stop_ids, im_end,
                               pad_id)
        wall_s = time.perf_counter() - started
    generation_s, training_s, tokens, trajectories, successes = parts
    return with_breakdown({"wall_s": wall_s, "generation_s": generation_s,
                           "training_s": training_s, "generated_tokens": tokens, "trajectories": trajectories,
                           "success_rate": successes / trajectories}, totals)


def _minimal_steps(steps, model, tokenizer, optimizer, tasks, order, generator, stop_ids, im_end, pad_id):
    """The training loop proper: ``steps`` times sample B trajectories, then one GRPO update."""
    from async_rl.envs.toy import ToyKeysEnv
    generation_s = training_s = 0.0
    tokens = trajectories = successes = 0
    for _ in range(steps):
        t0 = time.perf_counter()
        episodes = []
        for task in order.sample(tasks, B // N):
            for _member in range(N):
                env = ToyKeysEnv()
                prompt = tokenizer.apply_chat_template([{"role": "user", "content": env.reset(task)}],
                                                       add_generation_prompt=True, tokenize=True)
                if not isinstance(prompt, list):  # transformers 5 may return a BatchEncoding
                    prompt = list(prompt["input_ids"])
                episodes.append({"env": env, "prompt": prompt, "response": [], "model_mask": [], "logprobs": [],
                                 "reward": 0.0, "done": False, "success": False})
        tokens += play_turns(model, tokenizer, episodes, stop_ids, im_end, pad_id, generator)
        t1 = time.perf_counter()
        grpo_update(model, optimizer, episodes, pad_id)
        training_s += time.perf_counter() - t1
        generation_s += t1 - t0
        trajectories += len(episodes)
        successes += sum(e["success"] for e in episodes)
    return generation_s, training_s, tokens, trajectories, successes


# --------------------------------------------------------------------------------------------------------------
# the project's synchronous arm
# --------------------------------------------------------------------------------------------------------------
def run_project(model_path: str, steps: int, seed: int) -> dict:
    from async_rl.driver.learner import Learner

    training = [0.0]
    original = Learner.train_step

    def timed(self, batch):  # only to split the wall time; the arm runs unchanged
        t0 = time.perf_counter()
        try:
            return original(self, batch)
        finally:
            training[0] += time.perf_counter() - t0

    Learner.train_step = timed
    try:
        with compute_timer() as totals:
            run = T.run_algorithm("grpo", model_path, label="sync", steps=steps, batch=B, seed=seed,
                                  algo_overrides={"group_size": N}, driver_overrides={"synchronous": True})
    finally:
        Learner.train_step = original
    # run_algorithm times driver.run() only; the model loads before it ran no forward pass, so totals match
    return with_breakdown({"wall_s": run.wall_s, "generation_s": run.wall_s - training[0], "training_s": training[0],
            "generated_tokens": run.generated_tokens, "trajectories": run.trajectories_finished,
            "success_rate": run.mean("train/success_rate"),
            "env_calls": run.history[-1].get("rollout/env_calls"),
            "env_hung_calls": run.history[-1].get("rollout/env_hung_calls")}, totals)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 steps, 1 repeat (~20 s)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 12; quick 4)")
    parser.add_argument("--repeats", type=int, default=None, help="alternated runs of each side (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    steps = args.steps or (4 if args.quick else 12)
    repeats = args.repeats or (1 if args.quick else 3)
    C.set_threads()
    C.quiet_libraries()
    machine = C.machine_info()
    model = T.warm_model()
    runs: dict[str, list[dict]] = {"project": [], "minimal": []}
    started = time.perf_counter()
    for repeat in range(repeats):
        for side, fn in (("project", run_project), ("minimal", run_minimal)):
            result = fn(model, steps, args.seed)
            runs[side].append(result)
            print(f"  repeat {repeat + 1}/{repeats} {side}: {result['wall_s']:.2f} s (generation "
                  f"{result['generation_s']:.2f}, training {result['training_s']:.2f}; compute "
                  f"{result['compute_s']:.2f} in {result['forwards']} forwards, other {result['other_s']:.2f}), "
                  f"{result['generated_tokens']} tokens, {result['trajectories']} trajectories", flush=True)

    def median(side: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[side])

    summary = {side: {key: median(side, key) for key in ("wall_s", "generation_s", "training_s", "compute_s",
                                                          "other_s", "forward_s", "forwards", "backward_s",
                                                          "optimizer_s", "generated_tokens", "trajectories")}
               for side in runs}
    ratio = summary["project"]["wall_s"] / summary["minimal"]["wall_s"]
    # the sides sample different tokens, so the amount of work differs a little: the same ratio per token too
    per_token = {side: {"wall_ms": 1e3 * s["wall_s"] / s["generated_tokens"],
                        "generation_ms": 1e3 * s["generation_s"] / s["generated_tokens"]}
                 for side, s in summary.items()}
    per_token_ratio = per_token["project"]["wall_ms"] / per_token["minimal"]["wall_ms"]
    results = {
        "benchmark": "framework_overhead",
        "description": "async_vs_sync's sync arm (GRPO B=32 n=4, toy_keys) vs a minimal single-process GRPO loop, "
                       "same model and settings, alternated runs",
        "quick": args.quick,
        "setup": {"steps": steps, "repeats": repeats, "seed": args.seed, "batch_trajectories": B, "group_size": N,
                  "max_turns": MAX_TURNS, "max_new_tokens_per_turn": MAX_NEW_TOKENS,
                  "max_response_tokens": MAX_RESPONSE_TOKENS, "torch_threads": 1,
                  "model": "tiny Qwen2 (hidden 64, 2 layers), SFT warm start on toy_keys"},
        "runs": runs,
        "median": summary,
        "wall_ratio_project_over_minimal": ratio,
        "generation_ratio": summary["project"]["generation_s"] / summary["minimal"]["generation_s"],
        "training_ratio": summary["project"]["training_s"] / summary["minimal"]["training_s"],
        "tokens_ratio": summary["project"]["generated_tokens"] / summary["minimal"]["generated_tokens"],
        "other_ratio": summary["project"]["other_s"] / summary["minimal"]["other_s"],
        "per_generated_token": per_token,
        "wall_per_token_ratio": per_token_ratio,
        "target_ratio": TARGET_RATIO,
        "target_met": ratio <= TARGET_RATIO,
        "total_benchmark_wall_s": time.perf_counter() - started,
        "machine": machine,
    }
    path = C.save_json(C.result_stem("framework_overhead", args.quick), results)
    print(f"\n{steps} steps, medians of {repeats} alternated runs (load avg at start "
          f"{machine.get('load_avg_1m_at_start')}):")
    C.print_table([[side, s["wall_s"], s["generation_s"], s["training_s"], s["compute_s"], s["other_s"],
                    int(s["forwards"]), int(s["generated_tokens"]), int(s["trajectories"])]
                   for side, s in summary.items()],
                  ["side", "wall s", "generation s", "training s", "compute s", "other s", "forwards", "tokens",
                   "trajectories"])
    print(f"\nproject / minimal wall time = {ratio:.2f}x (target <= {TARGET_RATIO}x: "
          f"{'met' if ratio <= TARGET_RATIO else 'NOT met'}); generation {results['generation_ratio']:.2f}x, "
          f"training {results['training_ratio']:.2f}x, tokens generated {results['tokens_ratio']:.2f}x")
    print(f"outside model compute (forward, backward, AdamW): project {summary['project']['other_s']:.2f} s, "
          f"minimal {summary['minimal']['other_s']:.2f} s -> {results['other_ratio']:.2f}x")
    print(f"per generated token: project {per_token['project']['wall_ms']:.2f} ms, minimal "
          f"{per_token['minimal']['wall_ms']:.2f} ms -> {per_token_ratio:.2f}x")
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
