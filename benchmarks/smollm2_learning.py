"""Learning on the real model: GRPO vs LiSAO vs Li2SAO on the SmolLM2 recipe, several seeds, the same trajectory
budget (issue 36, item 5).

Every arm is the recipe as a user runs it: ``python -m async_rl.train --config-dir recipes --config-name smollm2
algorithm=<a> seed=<s>`` in a subprocess (its output to a file), with ``trainer.driver.total_steps`` steps of the
recipe's 16 trajectories each, so every arm trains on the same number of trajectories. All arms start from the
recipe's cached SFT warm start (``outputs/models/smollm2-sft-<dataset>-<steps>steps``, made first if missing, as the recipe
does). Before training, the warm start is evaluated once with ``async_rl.eval`` on the recipe's held-out items
(``--problems`` x ``--samples`` at temperature 1.0, hf engine); after training, each arm's exported model is
evaluated the same way. Records per arm: the success rate per step and its mean over the first and last quarter,
pass@k before and after, Li2SAO's switch (step, on evidence or forced), seconds per training step, and the
run's warnings. Saves ``results/smollm2_learning.json``.

    .venv/bin/python benchmarks/smollm2_learning.py [--algorithms grpo lisao li2sao] [--seeds 0 1] [--steps 100]
        [--problems 50] [--samples 4] [--overrides KEY=VALUE ...] [--out smollm2_learning]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, quiet_libraries, save_json, set_threads  # noqa: E402
from smollm2_start import evaluate  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def metric_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []


def quarter_means(values: list[float]) -> tuple[float, float]:
    quarter = max(1, len(values) // 4)
    return sum(values[:quarter]) / quarter, sum(values[-quarter:]) / quarter


def train_arm(algorithm: str, seed: int, steps: int, overrides: list[str], work: Path, timeout_s: float) -> dict:
    run_name = f"{algorithm}-s{seed}"
    command = [sys.executable, "-m", "async_rl.train", "--config-dir", "recipes", "--config-name", "smollm2",
               f"algorithm={algorithm}", f"seed={seed}", f"trainer.output_dir={work}", f"trainer.run_name={run_name}",
               "trainer.wandb=false", "trainer.export_model=true", f"trainer.driver.total_steps={steps}", *overrides]
    log_path = work / f"{run_name}.log"  # a file, not a pipe: a full pipe would block the trainer
    began = time.perf_counter()
    with open(log_path, "w") as log:
        completed = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True,
                                   timeout=timeout_s, env={**os.environ, "WANDB_MODE": "offline"})
    wall = time.perf_counter() - began
    if completed.returncode != 0:
        raise RuntimeError(f"{run_name} exited {completed.returncode}:\n{log_path.read_text()[-4000:]}")
    run_dir = work / run_name
    rows = metric_rows(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    success = [row["train/success_rate"] for row in rows]
    first, last = quarter_means(success)
    training_s = (summary.get("time_s") or {}).get("training")
    switch = summary.get("phases", {}).get("li2sao_switch", {})
    return {"algorithm": algorithm, "seed": seed, "command": " ".join(command[2:]), "steps": len(rows),
            "trajectories": int(sum(row.get("train/batch_trajectories", 0) for row in rows)),
            "success_per_step": success, "success_first_quarter": first, "success_last_quarter": last,
            "response_length_mean_per_step": [row.get("train/response_length/mean") for row in rows],
            # engine vs trainer log-probs of the sampled tokens, per step (rollout on vLLM or hf)
            "mismatch_abs_logprob_per_step": [row.get("rollout/mismatch_abs_logprob_mean") for row in rows],
            "policy_lag_mean_per_step": [row.get("async/policy_lag/mean") for row in rows],
            # Li2SAO's readiness statistics against its thresholds (eta_e, eta_a): why the gate opened or not
            "gate_per_step": {key: [row.get(f"li2sao/{key}") for row in rows]
                              for key in ("ema_explained_var", "ema_rank_acc", "gate_counter")}
            if algorithm == "li2sao" else None,
            "seconds_per_step": round(training_s / len(rows), 2) if training_s and rows else None,
            "wall_s": round(wall, 1), "time_s": summary.get("time_s"),
            "switch_step": summary.get("switch_step") if switch.get("ran") else None,
            "switch_on_evidence": switch.get("gate_opened_on_evidence") if switch.get("ran") else None,
            "warnings": summary.get("warnings", []), "model_dir": str(run_dir / "model")}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", nargs="+", default=["grpo", "lisao", "li2sao"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--problems", type=int, default=50)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--overrides", nargs="*", default=[], help="config overrides for every arm")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per arm")
    parser.add_argument("--out", default="smollm2_learning", help="result file stem under results/")
    args = parser.parse_args(argv)
    set_threads()
    quiet_libraries()
    from async_rl.cli_config import compose_command_line
    from async_rl.train import make_tasks, prepare_model

    cfg = compose_command_line(["--config-dir", str(REPO / "recipes"), "--config-name", "smollm2", *args.overrides])
    began = time.perf_counter()
    warm = prepare_model(cfg.model, cfg.env.name, cfg.seed, env_cfg=cfg.env, tasks=make_tasks(cfg.env, cfg.seed))
    warm_start_s = time.perf_counter() - began
    work = Path(tempfile.mkdtemp(prefix="smollm2_learning_"))
    try:
        before = evaluate(warm, cfg.env, args.problems, args.samples, work / "eval_before")
        print(f"warm start: success {before['success_rate']:.3f}, pass@k {before['pass_at_k']}", flush=True)
        arms = []
        for algorithm in args.algorithms:
            for seed in args.seeds:
                arm = train_arm(algorithm, seed, args.steps, args.overrides, work, args.timeout_s)
                arm["eval_after"] = evaluate(arm.pop("model_dir"), cfg.env, args.problems, args.samples,
                                             work / f"eval_{algorithm}_s{seed}")
                arms.append(arm)
                print(f"{algorithm} seed {seed}: success {arm['success_first_quarter']:.3f} -> "
                      f"{arm['success_last_quarter']:.3f} over {arm['steps']} steps ({arm['seconds_per_step']} s/step); "
                      f"held-out {before['success_rate']:.3f} -> {arm['eval_after']['success_rate']:.3f}, "
                      f"switch {arm['switch_step']} (evidence {arm['switch_on_evidence']})", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    payload = {"benchmark": "smollm2_learning", "machine": machine_info(), "recipe": "recipes/smollm2.yaml",
               "overrides": args.overrides, "dataset": cfg.env.dataset, "steps": args.steps,
               "trajectories_per_step": cfg.algorithm.train_batch_trajectories, "actor_lr": cfg.algorithm.actor_lr,
               "warm_start_dir": os.path.relpath(warm, REPO), "warm_start_s": round(warm_start_s, 1),
               "eval_before": before, "arms": arms,
               "rose": {f"{arm['algorithm']}-s{arm['seed']}": arm["success_last_quarter"] > arm["success_first_quarter"]
                        for arm in arms}}
    path = save_json(args.out, payload)
    print(f"saved {path}")
    return payload


if __name__ == "__main__":
    main()
