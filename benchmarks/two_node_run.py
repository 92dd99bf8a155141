"""A training run on a two-node Ray cluster that loses a node mid-run, and whether it still learns (issue 37, item 6).

Starts the cluster as a user does, with the ``ray`` CLI on this machine (``async_rl.workers.local_cluster``:
loopback, token authentication): a head (``head_node``) and a second node with no CPU and one ``rollout_node``
resource. Then ``python -m async_rl.train --config-name demo`` (the tiny model warm-started on toy_keys; its warm
start is cached in ``outputs/models/tiny-toy_keys``) joins it through ``RAY_ADDRESS`` with ``trainer.workers=ray``,
the concurrent scheduler and two hf replicas, one pinned to each node (``rollout.replica_resources``). After step
``--kill-after`` the second node's raylet and every process under it are killed by pid; the run goes on with the
head's replica. Records the success rate per step, its mean over the first and last tenth, the replicas alive per
step, the requests lost with the node, and wall times. Every process of the cluster is killed by pid at the end
(never ``ray stop``). Saves ``results/two_node_run.json``.

    .venv/bin/python benchmarks/two_node_run.py [--steps 60] [--kill-after 20] [--algorithm grpo]
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
from _common import machine_info, save_json  # noqa: E402

from async_rl.workers.local_cluster import LocalRayCluster  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def rows_of(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-after", type=int, default=20)
    parser.add_argument("--algorithm", default="grpo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="two_node_run_"))
    run = None
    with LocalRayCluster(head_cpus=6, head_resources={"head_node": 4}) as cluster:
        try:
            cluster.add_node(num_cpus=0, resources={"rollout_node": 1})
            run_dir = work / "out" / "two-node-run"
            command = [sys.executable, "-m", "async_rl.train", "--config-name", "demo",
                       f"algorithm={args.algorithm}", f"seed={args.seed}", f"trainer.output_dir={work / 'out'}",
                       "trainer.run_name=two-node-run", "trainer.wandb=false", "trainer.export_model=false",
                       "trainer.workers=ray", "trainer.scheduler=concurrent", f"trainer.driver.total_steps={args.steps}",
                       "rollout.replicas=2", "rollout.cpus_per_replica=0", "rollout.health_timeout_s=20",
                       "rollout.replica_resources=[{head_node:1},{rollout_node:1}]"]
            env = {**os.environ, **cluster.env, "RAY_ADDRESS": cluster.address, "WANDB_MODE": "offline"}
            began = time.perf_counter()
            log_path = work / "train_output.txt"  # a file, not a pipe: a full pipe would block the trainer
            with open(log_path, "w") as log:
                run = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
                killed_after, killed_at_s = None, None
                while run.poll() is None:
                    if time.perf_counter() - began > args.timeout_s:
                        raise RuntimeError(f"the run took more than {args.timeout_s} s:\n"
                                           f"{log_path.read_text()[-4000:]}")
                    if killed_after is None and len(rows_of(run_dir)) >= args.kill_after:
                        killed_after, killed_at_s = len(rows_of(run_dir)), time.perf_counter() - began
                        cluster.kill_node("rollout_node")
                    time.sleep(0.2)
            if run.returncode != 0:
                raise RuntimeError(f"the run exited {run.returncode}:\n{log_path.read_text()[-4000:]}")
            wall = time.perf_counter() - began
            rows = rows_of(run_dir)
            summary = json.loads((run_dir / "summary.json").read_text())
        finally:
            if run is not None and run.poll() is None:
                run.kill()
    success = [row["train/success_rate"] for row in rows]
    tenth = max(1, len(success) // 10)
    result = {
        "benchmark": "two_node_run", "machine": machine_info(), "command": " ".join(command[1:]),
        "algorithm": args.algorithm, "seed": args.seed, "steps": len(rows), "killed_after_step": killed_after,
        "killed_at_s": round(killed_at_s or 0.0, 1), "wall_s": round(wall, 1), "time_s": summary.get("time_s"),
        "success_first_tenth": sum(success[:tenth]) / tenth, "success_last_tenth": sum(success[-tenth:]) / tenth,
        "success_per_step": success,
        "replicas_alive_per_step": [row.get("rollout/replicas_alive") for row in rows],
        "replica_aborted": rows[-1].get("async/replica_aborted") if rows else None,
        "policy_version_last": rows[-1].get("trainer/policy_version") if rows else None,
    }
    shutil.rmtree(work, ignore_errors=True)
    path = save_json("two_node_run", result)
    print(f"{args.algorithm}: {len(rows)} steps, second node killed after step {killed_after}; success "
          f"{result['success_first_tenth']:.2f} -> {result['success_last_tenth']:.2f}; "
          f"{result['replica_aborted']} requests lost with the node; {wall:.0f} s. Saved {path}")
    return result


if __name__ == "__main__":
    main()
