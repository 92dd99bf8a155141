"""What periodic checkpoints cost the demo (issue 38, item 1): conf/demo.yaml checkpoints every 20 steps.

Runs ``python -m async_rl.train --config-name demo`` for ``--steps`` steps twice, with
``trainer.driver.checkpoint_every=0`` and ``=--every``, and records from each run's summary.json the seconds spent
writing checkpoints (``checkpoint_s``: the atomic write with its checksum, pruning, and the policy export each
checkpoint refreshes), the training wall time, the checkpoint size, and whether the two runs logged the same
metrics (wall-clock keys aside: checkpointing must not change training). The demo's warm-started model is the
one `make demo` builds (``outputs/models/tiny-toy_keys``; built on first use). Saves
``results/checkpoint_cost.json``.

    .venv/bin/python benchmarks/checkpoint_cost.py [--steps 20 --every 5]   # ~1.5 min
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


def run_demo(out: Path, name: str, steps: int, every: int) -> dict:
    args = [sys.executable, "-m", "async_rl.train", "--config-name", "demo", f"trainer.driver.total_steps={steps}",
            f"trainer.driver.checkpoint_every={every}", f"trainer.output_dir={out}", f"trainer.run_name={name}",
            "trainer.wandb=false"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"demo run failed ({done.returncode}): {done.stderr[-2000:]}")
    run_dir = out / name
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*.pt")) if every else []
    return {"process_wall_s": round(time.perf_counter() - started, 2), "wall_s": summary["wall_s"],
            "checkpoint_s": summary["checkpoint_s"], "checkpoints_written": steps // every if every else 0,
            "checkpoint_bytes": checkpoints[-1].stat().st_size if checkpoints else None,
            "rows": [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    opts = parser.parse_args()
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="checkpoint_cost_") as tmp:
        without = run_demo(Path(tmp), "without", opts.steps, 0)
        with_ = run_demo(Path(tmp), "with", opts.steps, opts.every)
    per_checkpoint = with_["checkpoint_s"] / max(with_["checkpoints_written"], 1)
    per_step = without["wall_s"] / opts.steps
    result = {
        "steps": opts.steps, "checkpoint_every": opts.every,
        "checkpoints_written": with_["checkpoints_written"], "checkpoint_bytes": with_["checkpoint_bytes"],
        "checkpoint_s_total": round(with_["checkpoint_s"], 3), "checkpoint_s_each": round(per_checkpoint, 3),
        "train_wall_s_without": round(without["wall_s"], 2), "train_wall_s_with": round(with_["wall_s"], 2),
        "train_s_per_step": round(per_step, 3),
        # what the demo's cadence costs: one checkpoint per 20 steps, relative to 20 steps of training
        "demo_cadence": 20, "demo_overhead_frac": round(per_checkpoint / (20 * per_step), 4),
        "same_metrics": without["rows"] == with_["rows"],
        "machine": machine,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))
    print(f"saved {save_json('checkpoint_cost', result)}")


if __name__ == "__main__":
    main()
