"""Time to a config error: ``python -m async_rl.train`` with a mistyped group, key and value (issue 38, item 3).

Each command runs ``--repeats`` times in a fresh process (cold interpreter, warm disk cache); the result records
the wall time from launch to exit, the exit status and the last stderr line. The CLI composes and checks the
config before it imports torch, Ray, verl or transformers (``async_rl.cli_config``), so every error should come
well under 3 s on this machine; before that change it took 16-28 s. Saves ``results/config_error_time.json``.

    .venv/bin/python benchmarks/config_error_time.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, save_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CASES = {
    "group": ["algorithm=lisoa"],
    "key": ["trainer.checkpoint_every=10"],
    "added_key": ["+trainer.foo=1"],
    "value": ["trainer.driver.total_steps=abc"],
}


def time_case(args: list[str], out_dir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "async_rl.train", *args, f"trainer.output_dir={out_dir}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - started
    lines = done.stderr.strip().splitlines()
    return {"wall_s": round(wall, 3), "returncode": done.returncode, "stderr_lines": len(lines),
            "last_line": lines[-1] if lines else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    out_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"config_error_time_{os.getpid()}"
    machine = machine_info()
    results = {}
    for name, args in CASES.items():
        runs = [time_case(args, out_dir) for _ in range(opts.repeats)]
        walls = [r["wall_s"] for r in runs]
        results[name] = {"command": "python -m async_rl.train " + " ".join(args), "median_wall_s": statistics.median(walls),
                         "max_wall_s": max(walls), "returncodes": sorted({r["returncode"] for r in runs}),
                         "stderr_lines": max(r["stderr_lines"] for r in runs), "message": runs[-1]["last_line"]}
        print(f"{name:>10}: median {results[name]['median_wall_s']:.2f} s, max {max(walls):.2f} s, exit "
              f"{results[name]['returncodes']}: {results[name]['message'][:100]}")
    path = save_json("config_error_time", {"repeats": opts.repeats, "cases": results, "machine": machine})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
