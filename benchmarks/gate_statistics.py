"""Li2SAO's readiness statistics per step, read from runs' ``metrics.jsonl`` (issue 36): why the gate opened or not.

For each run given as ``LABEL=PATH`` (a run folder or its ``metrics.jsonl``) it records, per step, the EMA of the
residual critic's explained variance (``li2sao/ema_explained_var``, the spec's e_k EMA), the EMA rank accuracy
(``li2sao/ema_rank_acc``), the gate's counter and whether the run had switched, with the thresholds ``eta_e`` and
``eta_a``; and, over the bootstrap steps (before the switch), the largest value of each EMA. Saves
``results/<out>.json``. Runs whose result files predate ``smollm2_learning.py``'s own ``gate_per_step`` field are read
this way from their metrics (the benchmark deletes its work folder: copy the metrics while it runs).

    .venv/bin/python benchmarks/gate_statistics.py seed2=/path/li2sao-s2/metrics.jsonl seed3=... --out NAME
        [--measured-on COMMIT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, save_json  # noqa: E402

KEYS = ("ema_explained_var", "ema_rank_acc", "gate_counter", "switched", "eta_e", "eta_a")


def read_rows(path: Path) -> list[dict]:
    path = path / "metrics.jsonl" if path.is_dir() else path
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def gate_statistics(rows: list[dict]) -> dict:
    per_step = {key: [row.get(f"li2sao/{key}") for row in rows] for key in KEYS}
    # the bootstrap's steps: switched is logged 0 before the switch, 1 at it, and no longer after it
    bootstrap = [i for i, switched in enumerate(per_step["switched"]) if switched == 0]

    def largest(key: str):
        values = [per_step[key][i] for i in bootstrap if per_step[key][i] is not None]
        return max(values) if values else None

    thresholds = {key: next((v for v in per_step[key] if v is not None), None) for key in ("eta_e", "eta_a")}
    return {"steps": len(rows), "bootstrap_steps": len(bootstrap),
            "switch_step": next((i + 1 for i, v in enumerate(per_step["switched"]) if v == 1), None),
            "max_ema_explained_var_in_bootstrap": largest("ema_explained_var"),
            "max_ema_rank_acc_in_bootstrap": largest("ema_rank_acc"), **thresholds,
            "per_step": {key: per_step[key] for key in ("ema_explained_var", "ema_rank_acc", "gate_counter",
                                                         "switched")}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="LABEL=PATH of a run folder or its metrics.jsonl")
    parser.add_argument("--out", required=True, help="result file stem under results/")
    parser.add_argument("--measured-on", default=None, help="the commit the runs were trained on, when known")
    args = parser.parse_args(argv)
    runs = {}
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep:
            parser.error(f"{spec!r}: give LABEL=PATH")
        runs[label] = gate_statistics(read_rows(Path(path)))
        print(f"{label}: {runs[label]['bootstrap_steps']} bootstrap steps; largest EMA explained variance "
              f"{runs[label]['max_ema_explained_var_in_bootstrap']:.4f} (eta_e {runs[label]['eta_e']}), rank accuracy "
              f"{runs[label]['max_ema_rank_acc_in_bootstrap']:.3f} (eta_a {runs[label]['eta_a']})")
    payload = {"benchmark": "gate_statistics", "machine": machine_info(), "runs_measured_on": args.measured_on,
               "runs": runs}
    print(f"saved {save_json(args.out, payload)}")
    return payload


if __name__ == "__main__":
    main()
