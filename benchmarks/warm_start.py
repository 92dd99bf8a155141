"""Success of the SFT warm start on the toy tasks (the table in docs/toy_tasks.md).

Builds the default tiny model (``async_rl.models.tiny``: hidden 64, 2 layers, vocab 512) in a temporary
directory and runs ``python -m async_rl.models.sft`` with ``--eval-tasks 100`` (eval seed 12345, temperature
1.0, 1 torch thread) for toy_keys (default ``blind_fraction`` 1.0), toy_keys with ``--blind-fraction 0.5``
(the default before) and toy_echo. Saves the CLI's report per row to ``results/warm_start.json`` with
machine info, commit and dirty flag.

Run: ``.venv/bin/python benchmarks/warm_start.py`` (3 SFT runs: ~1.5 min on a quiet box, several under load).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

ROWS = [
    ("toy_keys", ["--env", "toy_keys"]),
    ("toy_keys, --blind-fraction 0.5", ["--env", "toy_keys", "--blind-fraction", "0.5"]),
    ("toy_echo", ["--env", "toy_echo"]),
]


def main() -> dict:
    from async_rl.models import sft
    from async_rl.models.tiny import make_tiny_model

    C.quiet_libraries()
    machine = C.machine_info()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "tiny"
        make_tiny_model(base, seed=0)
        for i, (label, args) in enumerate(ROWS):
            started = time.perf_counter()
            report = sft.main(["--model", str(base), "--out", str(Path(tmp) / f"warm{i}"), "--eval-tasks", "100",
                               *args])
            rows.append({"label": label, "args": args, "seconds_with_eval": time.perf_counter() - started,
                         "report": report})
            ev = report["eval"][0]
            print(f"{label}: {ev}", flush=True)
    result = {"benchmark": "warm_start", "eval_tasks": 100, "eval_seed": 12345, "rows": rows, "machine": machine}
    print(f"saved {C.save_json('warm_start', result)}")
    return result


if __name__ == "__main__":
    main()
