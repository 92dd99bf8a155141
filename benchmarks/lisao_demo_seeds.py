"""Single-rollout LiSAO on the demo's config, as a user would run it from the CLI (docs/algorithms.md, Stability).

Runs ``python -m async_rl.train --config-name demo algorithm=lisao algorithm.group_size=1 seed=S
trainer.driver.total_steps=40`` for seeds 0, 1, 2 at the demo's actor lr (3e-4), and seed 0 at actor lr 1e-3 (issue
19's setting), each into a temporary directory. From each run's ``summary.json`` and ``metrics.jsonl`` it saves
the success of the first and last 10 % of steps, the collapse step, the lowest success after first reaching 0.9,
the peak ``actor/ppo_kl`` and ``actor/dis_kept_kl``, and the steps where the KL guard printed its warning
(``actor/kl_warning`` = 1), to ``results/lisao_demo_seeds.json`` with machine info, commit and dirty flag.

Run: ``.venv/bin/python benchmarks/lisao_demo_seeds.py [--steps 40]`` (~1 min per run on an idle 2-core box).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from async_rl.run_summary import collapse_step  # noqa: E402
from stability_map import after_peak  # noqa: E402

RUNS = ((0, 3e-4), (1, 3e-4), (2, 3e-4), (0, 1e-3))  # (seed, actor lr); 3e-4 is conf/demo.yaml's


def overrides(seed: int, actor_lr: float, steps: int) -> list[str]:
    return ["algorithm=lisao", "algorithm.group_size=1", f"seed={seed}", f"trainer.driver.total_steps={steps}",
            f"algorithm.actor_lr={actor_lr:g}"]


def read_run(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    success = [float(row.get("train/success_rate", 0.0)) for row in history]

    def peak(key: str) -> float | None:
        values = [float(row[key]) for row in history if key in row and row[key] == row[key]]
        return max(values) if values else None

    return {
        "train_accuracy_first_10pct": summary.get("train_accuracy_first_10pct"),
        "train_accuracy_last_10pct": summary.get("train_accuracy_last_10pct"),
        "collapse_step": collapse_step(success),
        **after_peak(success),
        "peak_ppo_kl": peak("actor/ppo_kl"),
        "peak_dis_kept_kl": peak("actor/dis_kept_kl"),
        "kl_warning_steps": [row.get("step", i + 1) for i, row in enumerate(history)
                             if row.get("actor/kl_warning") == 1.0],
        "kl_warning_rows": [{k: row.get(k) for k in ("step", "actor/ppo_kl", "actor/dis_kept_kl",
                                                         "async/policy_lag/mean")}
                            for row in history if row.get("actor/kl_warning") == 1.0],
        "success": success,
        "warnings": summary.get("warnings"),
    }


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    payload = {"benchmark": "lisao_demo_seeds", "machine": C.machine_info(), "steps": args.steps, "runs": []}
    for seed, actor_lr in RUNS:
        extra = overrides(seed, actor_lr, args.steps)
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "async_rl.train", "--config-name", "demo", f"trainer.output_dir={tmp}",
                   "trainer.run_name=run", *extra]
            started = time.perf_counter()
            subprocess.run(cmd, check=True, cwd=C.REPO, env={**os.environ, "WANDB_MODE": "offline"},
                           stdout=subprocess.DEVNULL)
            row = {"seed": seed, "actor_lr": actor_lr,
                   "command": " ".join(["python -m async_rl.train --config-name demo", *extra]),
                   "wall_s": time.perf_counter() - started, **read_run(Path(tmp) / "run")}
        payload["runs"].append(row)
        print(f"seed {seed} lr {actor_lr:g}: {_fmt(row['train_accuracy_first_10pct'])} -> "
              f"{_fmt(row['train_accuracy_last_10pct'])}, lowest after 0.9 {row['min_success_after_reach']}, "
              f"collapse {row['collapse_step']}, peak KL {_fmt(row['peak_ppo_kl'], 4)}, warnings at "
              f"{row['kl_warning_steps']} ({row['wall_s']:.0f} s)", flush=True)
    C.save_json("lisao_demo_seeds", payload)


if __name__ == "__main__":
    main()
