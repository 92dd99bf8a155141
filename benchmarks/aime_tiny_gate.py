"""The tiny aime recipe's Li2SAO readiness gate: does it open on evidence, and why it used not to (issue 19).

Two parts, saved to ``results/aime_tiny_gate.json`` with machine info, commit and dirty flag:

1. **Recipe runs.** ``python -m async_rl.train --config-dir recipes --config-name aime_tiny algorithm=li2sao``
   for ``--seeds`` (each seed builds and warm-starts its own tiny model), two at a time, and once more with
   ``algorithm.actor_lr=3e-4`` for ``--actor-lr-seeds``. Per run: switch step, forced or on evidence, the EMAs
   of e_k and a_k at the switch, the largest e_k, first/last train reward, wall time.
2. **Read-out fit.** On each seed's warm-started model, a frozen-attention critic (spec §4) is fit with Adam,
   full batch, ``FIT_STEPS`` steps, to the residual target ``Z_i = R_i - μ_g`` at ``V(s_{i,T_i})`` (the last
   model token, ``<|im_end|>``) on one mixed group per training record (3 right, 5 wrong boxed answers), then
   e_k and a_k (Eq. 12-13, ``readiness_statistics``) are read on fresh wrong answers, at critic lr 1e-3 and at
   the 4B recipe's 5e-6. ``tests/test_li2sao_readout.py`` asserts the same on two seeds.

Run: ``.venv/bin/python benchmarks/aime_tiny_gate.py [--seeds 0 1 2 3]`` (~5 min on the 2-core box).
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
FIT_STEPS = 150
DATA = "recipes/data/dapo_math_mini.parquet"


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


def answer_groups(model_path: str, tasks, kwargs, draw_seed: int):
    """Left-padded rows ``prompt + \\boxed{answer} <|im_end|>``, one mixed group per record, with scores and
    group ids."""
    from async_rl.driver.episode import ChatFormatter
    from async_rl.envs.base import make_env
    from async_rl.envs.demonstrations import _wrong_number
    from async_rl.models.loading import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    chat, env, rng = ChatFormatter(tokenizer), make_env("math", **kwargs), random.Random(draw_seed)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows, scores, groups = [], [], []
    for g, task in enumerate(tasks):
        prompt = chat.prompt_ids(env.reset(task))
        answer = str(task["answer"]).strip()
        for text, reward in [(answer, 1.0)] * RIGHT + [(_wrong_number(rng, answer), 0.0) for _ in range(WRONG)]:
            rows.append(prompt + tokenizer(f"\\boxed{{{text}}}", add_special_tokens=False)["input_ids"] + [end])
            scores.append(reward)
            groups.append(g)
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        attention[i, width - len(row):] = 1
    return ids, attention, torch.tensor(scores), torch.tensor(groups)


def _terminal_values(critic, ids, attention):
    # V(s_T) of the last model token (<|im_end|>) is read where that token is predicted: one position before
    return critic(ids, attention)[:, -2]


def readout_fit(model_path: str, tasks, kwargs, lr: float, steps: int = FIT_STEPS) -> tuple[float, float]:
    """``(e_k, a_k)`` on fresh wrong answers after fitting the critic's terminal values to ``Z``."""
    from async_rl.algos.li2sao import group_statistics, readiness_from_statistics, readiness_statistics
    from async_rl.models.critic import CriticModel

    torch.manual_seed(0)
    critic = CriticModel.from_pretrained_policy(model_path, freeze_attention=True)
    ids, attention, scores, groups = answer_groups(model_path, tasks, kwargs, draw_seed=1)
    mean, _, _ = group_statistics(scores, groups)
    residual = scores - mean
    optimizer = torch.optim.Adam([p for p in critic.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        loss = (_terminal_values(critic, ids, attention) - residual).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    held = answer_groups(model_path, tasks, kwargs, draw_seed=2)
    with torch.no_grad():
        values = _terminal_values(critic, held[0], held[1])
    return readiness_from_statistics(readiness_statistics(values, held[2], held[3]))


# ----------------------------------------------------------------------------------------------------
# part 1: recipe runs
# ----------------------------------------------------------------------------------------------------
def _launch(tmp: Path, seed: int, overrides: list[str]) -> tuple[subprocess.Popen, Path, float]:
    out = tmp / f"run_{seed}_{len(overrides)}"
    cmd = [sys.executable, "-m", "async_rl.train", "--config-dir", "recipes", "--config-name", "aime_tiny",
           "algorithm=li2sao", f"seed={seed}", "trainer.wandb=false", f"trainer.output_dir={out}",
           f"model.dir={tmp / f'model_{seed}'}", *overrides]
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    log = open(tmp / f"log_{seed}_{len(overrides)}.txt", "w")
    return subprocess.Popen(cmd, cwd=C.REPO, env=env, stdout=log, stderr=subprocess.STDOUT), out, time.perf_counter()


def _summarise(seed: int, overrides: list[str], out: Path, wall_s: float) -> dict:
    run_dir = out / "aime-tiny-li2sao"
    summary = json.loads((run_dir / "summary.json").read_text())
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    switch = summary["phases"]["li2sao_switch"]
    at_switch = next(row for row in history if row.get("step") == switch["step"])
    e_values = [row["li2sao/explained_var_residual"] for row in history if "li2sao/explained_var_residual" in row]
    rewards = [row.get("train/reward_mean", 0.0) for row in history]
    return {"seed": seed, "overrides": overrides, "steps": summary["steps"], "switch_step": switch["step"],
            "gate_opened_on_evidence": switch["gate_opened_on_evidence"],
            "ema_e_at_switch": at_switch.get("li2sao/ema_explained_var"),
            "ema_a_at_switch": at_switch.get("li2sao/ema_rank_acc"), "e_k_max": max(e_values),
            "reward_first_10_steps": sum(rewards[:10]) / 10, "reward_last_10_steps": sum(rewards[-10:]) / 10,
            "warnings": summary["warnings"], "wall_s": round(wall_s, 1)}


def recipe_runs(seeds: list[int], actor_lr_seeds: list[int], tmp: Path) -> list[dict]:
    jobs = [(s, []) for s in seeds] + [(s, ["algorithm.actor_lr=3e-4"]) for s in actor_lr_seeds]
    rows, live = [], []
    while jobs or live:
        while jobs and len(live) < 2:  # two at a time: one core each
            seed, overrides = jobs.pop(0)
            live.append((seed, overrides, *_launch(tmp, seed, overrides)))
        seed, overrides, proc, out, started = live.pop(0)
        if proc.wait() != 0:
            raise RuntimeError(f"aime_tiny seed {seed} {overrides} failed: see {tmp}/log_{seed}_{len(overrides)}.txt")
        rows.append(_summarise(seed, overrides, out, time.perf_counter() - started))
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--actor-lr-seeds", type=int, nargs="*", default=[0, 1])
    parser.add_argument("--fit-seeds", type=int, nargs="*", default=[0, 1, 2])
    args = parser.parse_args(argv)
    C.set_threads()
    C.quiet_libraries()
    machine = C.machine_info()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        runs = recipe_runs(args.seeds, args.actor_lr_seeds, Path(tmp))
        fits = []
        for seed in args.fit_seeds:
            model = recipe_model(Path(tmp) / f"fit_{seed}", seed)
            for lr in (1e-3, 5e-6):
                e_k, a_k = readout_fit(*model, lr=lr)
                fits.append({"seed": seed, "critic_lr": lr, "steps": FIT_STEPS, "e_k_heldout": e_k, "a_k_heldout": a_k})
    result = {"benchmark": "aime_tiny_gate", "recipe": "recipes/aime_tiny.yaml", "runs": runs,
              "readout_fit": {"right_per_group": RIGHT, "wrong_per_group": WRONG, "rows": fits},
              "total_wall_s": round(time.perf_counter() - started, 1), "machine": machine}
    path = C.save_json("aime_tiny_gate", result)
    for r in runs:
        print(f"seed {r['seed']} {' '.join(r['overrides']) or 'recipe'}: switch at {r['switch_step']} "
              f"({'evidence' if r['gate_opened_on_evidence'] else 'forced'}), EMA e_k {r['ema_e_at_switch']:.2f} "
              f"a_k {r['ema_a_at_switch']:.2f}, reward {r['reward_first_10_steps']:.2f} -> "
              f"{r['reward_last_10_steps']:.2f}, {r['wall_s']} s")
    for f in fits:
        print(f"read-out fit seed {f['seed']} lr {f['critic_lr']:g}: e_k {f['e_k_heldout']:.3f} a_k {f['a_k_heldout']:.2f}")
    print(f"saved {path}")
    return result


if __name__ == "__main__":
    main()
