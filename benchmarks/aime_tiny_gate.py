"""The tiny aime recipe's Li2SAO readiness gate: does it open on evidence, and why it used not to (issue 19).

Two parts, saved to ``results/aime_tiny_gate.json`` with machine info, commit and dirty flag:

1. **Recipe runs.** ``python -m async_rl.train --config-dir recipes --config-name aime_tiny algorithm=li2sao``
   for ``--seeds`` (each seed warm-starts its own tiny model, built once up front), two at a time. Then, on
   seeds 0 and 1, the arms of :data:`ABLATIONS`: the old recipe and one factor of the new one at a time. Per
   run: switch step, forced or on evidence, the EMAs of e_k and a_k at the switch, the largest e_k, the
   steps with a mixed group, first/last train reward, wall time.
2. **Read-out fit.** On each seed's warm-started model, a frozen-attention critic (spec §4) is fit with Adam,
   full batch, ``FIT_STEPS`` steps, by plain squared error (not the trainer's clipped value loss plus ranking
   term) to the residual target ``Z_i = R_i - μ_g`` at ``V(s_{i,T_i})`` (the last model token,
   ``<|im_end|>``), on one mixed group per training record (3 right, 5 wrong boxed answers). Then e_k and a_k
   (Eq. 12-13, ``readiness_statistics``) are read on wrong answers not seen in the fit (the right answer is
   the same string), at critic lr 1e-3 and at the 4B recipe's 5e-6. ``tests/test_li2sao_readout.py`` asserts
   the same on two seeds.

Run: ``.venv/bin/python benchmarks/aime_tiny_gate.py [--seeds 0 1 2 3]`` (~6 min on the 2-core box).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

RIGHT, WRONG = 3, 5  # per training record: a mixed group of n_b = 8
FIT_STEPS = 300  # full-batch Adam steps: enough for every measured seed to leave the plateau at lr 1e-3
DATA = "recipes/data/dapo_math_mini.parquet"
# (label, overrides): the recipe before this benchmark, then the new recipe less one of its changes
ABLATIONS = [
    ("old recipe: B 8, critic lr 5e-6, gate 1/2/4, 5 steps",
     ["algorithm.train_batch_trajectories=8", "algorithm.critic_lr=5e-6", "algorithm.gate.t_min=1",
      "algorithm.gate.patience=2", "algorithm.gate.t_max=4", "trainer.driver.total_steps=5",
      "trainer.driver.max_inflight_trajectories=16"]),
    ("new recipe with critic lr 5e-6", ["algorithm.critic_lr=5e-6"]),
    ("new recipe with B 8 (one group per step)", ["algorithm.train_batch_trajectories=8",
                                                  "trainer.driver.max_inflight_trajectories=16"]),
    ("new recipe with actor lr 3e-4", ["algorithm.actor_lr=3e-4"]),
]
ABLATION_SEEDS = (0, 1)


# ----------------------------------------------------------------------------------------------------
# part 2: the read-out fit (also used by tests/test_li2sao_readout.py)
# ----------------------------------------------------------------------------------------------------
def recipe_model(tmp_path: Path, seed: int):
    """``(model_path, training records, env kwargs)``: the recipe's warm-started model for ``seed``, composed
    as ``python -m async_rl.train --config-dir recipes --config-name aime_tiny`` composes it."""
    from hydra import compose, initialize_config_dir

    from async_rl.train import env_kwargs, make_tasks, prepare_model

    with initialize_config_dir(config_dir=str(C.REPO / "recipes"), version_base=None):
        cfg = compose(config_name="aime_tiny", overrides=[
            f"hydra.searchpath=[file://{C.REPO / 'conf'}]", "algorithm=li2sao", f"seed={seed}",
            f"model.dir={tmp_path / 'model'}", f"env.train_data={C.REPO / DATA}"])
    tasks = make_tasks(cfg.env, seed)
    return prepare_model(cfg.model, cfg.env.name, seed, env_cfg=cfg.env, tasks=tasks), tasks, env_kwargs(cfg.env)


def answer_groups(model_path: str, tasks, kwargs, draw_seed: int, exclude: dict[int, set[str]] | None = None):
    """Left-padded rows ``prompt + \\boxed{answer} <|im_end|>``, one mixed group per record, with scores,
    group ids and the wrong answers drawn per record; ``exclude`` holds wrong answers not to draw again
    (with replacement among the rest; all of them again if none is left)."""
    from async_rl.driver.episode import ChatFormatter
    from async_rl.envs.base import make_env
    from async_rl.models.loading import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    chat, env, rng = ChatFormatter(tokenizer), make_env("math", **kwargs), random.Random(draw_seed)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows, scores, groups, drawn = [], [], [], {}
    for g, task in enumerate(tasks):
        prompt = chat.prompt_ids(env.reset(task))
        answer = str(task["answer"]).strip()
        if not answer.lstrip("-").isdigit():
            raise ValueError(f"record {g}: the read-out fit needs an integer answer, got {answer!r}")
        seen = (exclude or {}).get(g, set())
        # wrong as the warm start's noisy demonstrations are: one digit changed
        changed = {answer[:i] + d + answer[i + 1:] for i, ch in enumerate(answer) if ch.isdigit()
                   for d in "0123456789" if d != ch}
        pool = sorted(changed - seen) or sorted(changed)
        wrong = [rng.choice(pool) for _ in range(WRONG)]
        drawn[g] = set(wrong)
        for text, reward in [(answer, 1.0)] * RIGHT + [(w, 0.0) for w in wrong]:
            rows.append(prompt + tokenizer(f"\\boxed{{{text}}}", add_special_tokens=False)["input_ids"] + [end])
            scores.append(reward)
            groups.append(g)
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        attention[i, width - len(row):] = 1
    return ids, attention, torch.tensor(scores), torch.tensor(groups), drawn


def _terminal_values(critic, ids, attention):
    # V(s_T) of the last model token (<|im_end|>) is read where that token is predicted: one position before
    return critic(ids, attention)[:, -2]


def readout_fit(model_path: str, tasks, kwargs, lr: float, steps: int = FIT_STEPS) -> dict[str, float]:
    """Fit the terminal values to ``Z``; e_k and a_k on the fitted groups and on wrong answers it did not see."""
    from async_rl.algos.li2sao import group_statistics, readiness_from_statistics, readiness_statistics
    from async_rl.models.critic import CriticModel

    torch.manual_seed(0)
    critic = CriticModel.from_pretrained_policy(model_path, freeze_attention=True)
    ids, attention, scores, groups, seen = answer_groups(model_path, tasks, kwargs, draw_seed=1)
    mean, _, _ = group_statistics(scores, groups)
    residual = scores - mean
    optimizer = torch.optim.Adam([p for p in critic.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        loss = (_terminal_values(critic, ids, attention) - residual).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    held = answer_groups(model_path, tasks, kwargs, draw_seed=2, exclude=seen)
    out = {}
    for name, (rows, mask, rewards, group_ids) in {"fit": (ids, attention, scores, groups),
                                                    "unseen": held[:4]}.items():
        with torch.no_grad():
            values = _terminal_values(critic, rows, mask)
        out[f"e_k_{name}"], out[f"a_k_{name}"] = readiness_from_statistics(
            readiness_statistics(values, rewards, group_ids))
    return out


# ----------------------------------------------------------------------------------------------------
# part 1: recipe runs
# ----------------------------------------------------------------------------------------------------
def _launch(tmp: Path, index: int, seed: int, model_dir: Path, overrides: list[str]):
    out = tmp / f"run_{index}"
    cmd = [sys.executable, "-m", "async_rl.train", "--config-dir", "recipes", "--config-name", "aime_tiny",
           "algorithm=li2sao", f"seed={seed}", "trainer.wandb=false", f"trainer.output_dir={out}",
           f"model.dir={model_dir}", *overrides]
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    with open(tmp / f"log_{index}.txt", "w") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, cwd=C.REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, out, time.perf_counter()


def _summarise(label: str, seed: int, overrides: list[str], out: Path, wall_s: float) -> dict:
    run_dir = out / "aime-tiny-li2sao"
    summary = json.loads((run_dir / "summary.json").read_text())
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    switch = summary["phases"]["li2sao_switch"]
    at_switch = next(row for row in history if row.get("step") == switch["step"])
    e_values = [row["li2sao/explained_var_residual"] for row in history if "li2sao/explained_var_residual" in row]
    rewards = [row.get("train/reward_mean", 0.0) for row in history]
    window = min(10, len(rewards))
    return {"label": label, "seed": seed, "overrides": overrides, "steps": summary["steps"],
            "switch_step": switch["step"], "gate_opened_on_evidence": switch["gate_opened_on_evidence"],
            "ema_e_at_switch": at_switch.get("li2sao/ema_explained_var"),
            "ema_a_at_switch": at_switch.get("li2sao/ema_rank_acc"),
            "e_k_max": max(e_values) if e_values else None,
            "bootstrap_steps_with_mixed_group": len(e_values),
            "reward_first_10_steps": sum(rewards[:window]) / window,
            "reward_last_10_steps": sum(rewards[-window:]) / window,
            "warnings": summary["warnings"], "wall_s": round(wall_s, 1)}


def recipe_runs(jobs: list[tuple[str, int, list[str]]], models: dict[int, Path], tmp: Path) -> list[dict]:
    """Run ``(label, seed, overrides)`` jobs two at a time (one core each) on the seeds' prebuilt models."""
    rows, live, pending = [], [], list(enumerate(jobs))
    while pending or live:
        while pending and len(live) < 2:
            index, (label, seed, overrides) = pending.pop(0)
            live.append((index, label, seed, overrides, *_launch(tmp, index, seed, models[seed], overrides)))
        index, label, seed, overrides, proc, out, started = live.pop(0)
        if proc.wait() != 0:
            raise RuntimeError(f"aime_tiny {label} seed {seed} failed: see {tmp}/log_{index}.txt")
        rows.append(_summarise(label, seed, overrides, out, time.perf_counter() - started))
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--fit-seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--no-ablations", dest="ablations", action="store_false")
    args = parser.parse_args(argv)
    C.set_threads()
    C.quiet_libraries()
    machine = C.machine_info()
    started = time.perf_counter()
    jobs = [("recipe", seed, []) for seed in args.seeds]
    if args.ablations:
        jobs += [(label, seed, overrides) for label, overrides in ABLATIONS for seed in ABLATION_SEEDS]
    with tempfile.TemporaryDirectory() as tmp:
        seeds = sorted({seed for _, seed, _ in jobs} | set(args.fit_seeds))
        # built once per seed, before any run: two runs of a seed never race to build the same model
        built = {seed: recipe_model(Path(tmp) / f"seed_{seed}", seed) for seed in seeds}
        runs = recipe_runs(jobs, {seed: Path(tmp) / f"seed_{seed}" / "model" for seed in seeds}, Path(tmp))
        fits = []
        for seed in args.fit_seeds:
            for lr in (1e-3, 5e-6):
                fits.append({"seed": seed, "critic_lr": lr, "steps": FIT_STEPS, **readout_fit(*built[seed], lr=lr)})
    result = {"benchmark": "aime_tiny_gate", "recipe": "recipes/aime_tiny.yaml", "runs": runs,
              "readout_fit": {"right_per_group": RIGHT, "wrong_per_group": WRONG, "records": len(built[seeds[0]][1]),
                              "loss": "squared error at V(s_T), Adam, full batch", "rows": fits},
              "total_wall_s": round(time.perf_counter() - started, 1), "machine": machine}
    path = C.save_json("aime_tiny_gate", result)
    for r in runs:
        print(f"{r['label']}, seed {r['seed']}: switch at {r['switch_step']} "
              f"({'evidence' if r['gate_opened_on_evidence'] else 'forced'}), EMA e_k {r['ema_e_at_switch']:.2f} "
              f"a_k {r['ema_a_at_switch']:.2f}, max e_k {r['e_k_max']}, reward {r['reward_first_10_steps']:.2f} -> "
              f"{r['reward_last_10_steps']:.2f}, {r['wall_s']} s")
    for f in fits:
        print(f"read-out fit seed {f['seed']} lr {f['critic_lr']:g}: fitted groups e_k {f['e_k_fit']:.3f} "
              f"a_k {f['a_k_fit']:.2f}; unseen wrong answers e_k {f['e_k_unseen']:.3f} a_k {f['a_k_unseen']:.2f}")
    print(f"saved {path}")
    return result


if __name__ == "__main__":
    main()
