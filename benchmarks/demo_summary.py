"""`make demo`'s run, saved as a result: the numbers the README's demo paragraph quotes.

Runs ``python -m async_rl.train --config-name demo`` (Li2SAO, async in-flight, toy_keys, seed 0, 120 steps)
into a temporary output directory and saves its ``summary.json`` plus, from ``metrics.jsonl``, the first
step at which the gate's EMA of e_k passes η_e, to ``results/demo_summary.json`` with machine info, commit
and dirty flag.

Run: ``.venv/bin/python benchmarks/demo_summary.py [extra Hydra overrides]`` (~2-5 min on the shared box).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

SUMMARY_KEYS = ("steps", "train_accuracy_first_10pct", "train_accuracy_last_10pct", "switch_step", "switch_forced",
                "mean_policy_lag", "off_policy_token_ratio", "trajectories_per_s", "dropped_stale", "aborted",
                "wall_s", "total_wall_s", "warnings")


def main(argv: list[str] | None = None) -> dict:
    overrides = list(sys.argv[1:] if argv is None else argv)
    machine = C.machine_info()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "async_rl.train", "--config-name", "demo", f"trainer.output_dir={tmp}",
               "trainer.run_name=demo", *overrides]
        started = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=C.REPO, env={**os.environ, "WANDB_MODE": "offline"})
        elapsed = time.perf_counter() - started
        run_dir = Path(tmp) / "demo"
        summary = json.loads((run_dir / "summary.json").read_text())
        history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    eta_e = 0.2  # conf/algorithm/li2sao.yaml gate.eta_e (the demo keeps it)
    crossing = next((row.get("step", i + 1) for i, row in enumerate(history)
                     if float(row.get("li2sao/ema_explained_var", float("-inf"))) > eta_e), None)
    result = {
        "benchmark": "demo_summary",
        "command": " ".join(["python -m async_rl.train --config-name demo", *overrides]),
        "summary": {k: summary.get(k) for k in SUMMARY_KEYS},
        "ema_e_first_step_above_eta_e": crossing,
        "eta_e": eta_e,
        "subprocess_wall_s": elapsed,
        "machine": machine,
    }
    path = C.save_json("demo_summary", result)
    s = result["summary"]
    print(f"switch at step {s['switch_step']} (forced: {s['switch_forced']}); EMA e_k > {eta_e} from step {crossing}; "
          f"accuracy {s['train_accuracy_first_10pct']:.2f} -> {s['train_accuracy_last_10pct']:.2f}; "
          f"{s['wall_s']:.0f} s of training")
    print(f"saved {path}")
    return result


if __name__ == "__main__":
    main()
