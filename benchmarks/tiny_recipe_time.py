"""Where a SIZE=tiny agent recipe's time goes: the warm start against training (issue 38, item 7); and the
real-model recipe's (``--tasks smollm2``: recipes/smollm2.yaml with GRPO for 3 steps, issue 36).

Runs ``python -m async_rl.train --config-dir recipes --config-name <task>_tiny`` for WebShop and ALFWorld from a
fresh model folder (so the tiny model is built and warm-started), then again on the same folder (the warm start is
cached: what every later run of the recipe costs). Records each run's ``time_s`` split from its ``summary.json``
(setup, warm_start, build, training, export, total), the SFT statistics (steps, demonstrations, their mean length,
seconds) and the seconds per SFT step. Saves ``results/tiny_recipe_time.json``.

    .venv/bin/python benchmarks/tiny_recipe_time.py [--tasks webshop alfworld] [--out NAME]
    .venv/bin/python benchmarks/tiny_recipe_time.py --tasks smollm2 --out smollm2_recipe_time
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
from _common import machine_info, save_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ALGORITHM = {"webshop": "sapo", "alfworld": "sapo", "smollm2": "grpo"}  # the README's commands
# smollm2: the real-model recipe (recipes/smollm2.yaml) for --smollm2-steps steps; its model is the converted
# SmolLM2 (outputs/models/smollm2, make smollm2), its warm start goes to a fresh folder here
SMOLLM2_STEPS = 3


def run_recipe(task: str, work: Path, label: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "WANDB_MODE": "offline"}
    if task == "smollm2":
        where = [f"model.sft.dir={work / 'model' / 'sft'}", f"trainer.driver.total_steps={SMOLLM2_STEPS}",
                 "trainer.export_model=false"]
    else:
        env["OMP_NUM_THREADS"] = "1"
        where = [f"model.dir={work / 'model'}"]
    args = [sys.executable, "-m", "async_rl.train", "--config-dir", str(REPO / "recipes"), "--config-name",
            task if task == "smollm2" else f"{task}_tiny", f"algorithm={ALGORITHM[task]}", "trainer.wandb=false",
            *where, f"trainer.output_dir={work / label}"]
    started = time.perf_counter()
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{task} ({label}) exited {done.returncode}:\n{done.stderr[-3000:]}")
    summary = json.loads(next((work / label).glob("*/summary.json")).read_text())
    return {"label": label, "wall_s": round(wall, 1), "time_s": summary["time_s"], "steps": summary["steps"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["alfworld", "webshop"], choices=sorted(ALGORITHM))
    parser.add_argument("--out", default="tiny_recipe_time", help="result file stem under results/")
    args = parser.parse_args(argv)
    rows = []
    for task in args.tasks:
        with tempfile.TemporaryDirectory(prefix=f"tiny_recipe_time_{task}_") as tmp:
            work = Path(tmp)
            first = run_recipe(task, work, "first")  # builds and warm-starts the tiny model
            again = run_recipe(task, work, "again")  # the warm start is cached in model.dir
            stats = json.loads((work / "model" / "sft" / "sft_stats.json").read_text())
        sft = {key: stats[key] for key in ("steps", "clean_steps", "num_demos", "batch_size", "mean_demo_tokens",
                                           "max_demo_tokens", "demo_success_rate", "seconds")}
        sft["seconds_per_step"] = round(stats["seconds"] / max(stats["steps"], 1), 3)
        if task == "smollm2":
            sft["training_steps"] = SMOLLM2_STEPS
            sft["seconds_per_training_step"] = round(first["time_s"]["training"] / SMOLLM2_STEPS, 1)
        row = {"task": task, "algorithm": ALGORITHM[task], "first_run": first, "cached_run": again, "sft": sft,
               "warm_start_share_of_first_run": round(first["time_s"]["warm_start"] / first["time_s"]["total"], 3)}
        rows.append(row)
        print(f"{task}: first run {first['time_s']['total']:.0f} s (warm start {first['time_s']['warm_start']:.0f} s, "
              f"training {first['time_s']['training']:.0f} s); with the warm start cached "
              f"{again['time_s']['total']:.0f} s; SFT {sft['steps']} steps of ~{sft['mean_demo_tokens']:.0f} tokens, "
              f"{sft['seconds_per_step']:.2f} s a step", flush=True)
    payload = {"benchmark": args.out, "machine": machine_info(), "rows": rows}
    path = save_json(args.out, payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
