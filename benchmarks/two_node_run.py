"""A training run on a two-node Ray cluster that loses a node mid-run, and whether it still learns (issue 37, item 6).

Starts the cluster as a user does, with the ``ray`` CLI on this machine (loopback, token authentication): a head
(``head_node``) and a second node with no CPU and one ``rollout_node`` resource. Then ``python -m async_rl.train
--config-name demo`` (the tiny model warm-started on toy_keys; its warm start is cached in
``outputs/models/tiny-toy_keys``) joins it through ``RAY_ADDRESS`` with ``trainer.workers=ray``, the concurrent
scheduler and two hf replicas, one pinned to each node (``rollout.replica_resources``). After step
``--kill-after`` the second node's raylet and every process under it are killed by pid (the raylet found by its resource, the cluster's
processes by its own --temp-dir); the run goes on with the
head's replica. Records the success rate per step, its mean over the first and last tenth, the steps with both
replicas alive, the requests lost with the node, and wall times. Every process started is killed by pid at the
end (never ``ray stop``). Saves ``results/two_node_run.json``.

    .venv/bin/python benchmarks/two_node_run.py [--steps 60] [--kill-after 20] [--algorithm grpo]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, save_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.urandom(16).hex()}


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports in 7500-7999 (each probed; none is bound before Ray takes it)."""
    ports: list[int] = []
    for port in random.sample(range(7500, 8000), 500):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError("not enough free ports in 7500-7999")


def processes_of(temp_dir: str, marker: str = "") -> set[int]:
    """Processes of the cluster whose session files are under ``temp_dir`` (every Ray process of it names that
    folder on its command line), optionally only those whose command line also holds ``marker``."""
    found = set()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            text = " ".join(proc.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if temp_dir in text and marker in text:
            found.add(proc.info["pid"])
    return found


def tree(pids: set[int]) -> set[int]:
    out = set(pids)
    for pid in pids:
        try:
            out |= {child.pid for child in psutil.Process(pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    return out


def kill(pids: set[int]) -> None:
    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass


def second_node(temp_dir: str) -> set[int]:
    """The second node: its raylet (the one started with the ``rollout_node`` resource) and every process under it
    (its agents and workers, the replica among them)."""
    raylets = set()
    for pid in processes_of(temp_dir, "rollout_node"):
        try:
            if "raylet" in " ".join(psutil.Process(pid).cmdline()):
                raylets.add(pid)
        except psutil.NoSuchProcess:
            pass
    if len(raylets) != 1:
        raise RuntimeError(f"expected one raylet with the rollout_node resource, found {sorted(raylets)}")
    return tree(raylets)


def ray_start(*args: str) -> None:
    done = subprocess.run([RAY, "start", *args, "--disable-usage-stats"], capture_output=True, text=True,
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **AUTH}, timeout=180)
    if done.returncode != 0:
        raise RuntimeError(f"ray start {' '.join(args)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


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
    temp_dir = tempfile.mkdtemp(prefix="tn", dir="/tmp")  # short: unix socket paths are limited to 107 bytes
    work = Path(tempfile.mkdtemp(prefix="two_node_run_"))
    run = None
    try:
        port, client_port, agent_head, agent_second = free_ports(4)
        ray_start("--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=6",
                  "--resources={\"head_node\": 4}", "--include-dashboard=false",
                  f"--ray-client-server-port={client_port}", f"--dashboard-agent-listen-port={agent_head}",
                  f"--temp-dir={temp_dir}")
        ray_start(f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.1", "--num-cpus=0",
                  "--resources={\"rollout_node\": 1}", f"--dashboard-agent-listen-port={agent_second}",
                  f"--temp-dir={temp_dir}")
        run_dir = work / "out" / "two-node-run"
        command = [sys.executable, "-m", "async_rl.train", "--config-name", "demo", f"algorithm={args.algorithm}",
                   f"seed={args.seed}", f"trainer.output_dir={work / 'out'}", "trainer.run_name=two-node-run",
                   "trainer.wandb=false", "trainer.export_model=false", "trainer.workers=ray",
                   "trainer.scheduler=concurrent", f"trainer.driver.total_steps={args.steps}",
                   "rollout.replicas=2", "rollout.cpus_per_replica=0", "rollout.health_timeout_s=20",
                   "rollout.replica_resources=[{head_node:1},{rollout_node:1}]"]
        env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{port}", "WANDB_MODE": "offline", **AUTH}
        began = time.perf_counter()
        log_path = work / "train_output.txt"  # a file, not a pipe: a full pipe would block the trainer
        with open(log_path, "w") as log:
            run = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
            killed_after, killed_at_s = None, None
            deadline = began + args.timeout_s
            while run.poll() is None:
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"the run took more than {args.timeout_s} s:\n{log_path.read_text()[-4000:]}")
                rows = rows_of(run_dir)
                if killed_after is None and len(rows) >= args.kill_after:
                    killed_after, killed_at_s = len(rows), time.perf_counter() - began
                    kill(second_node(temp_dir))
                time.sleep(0.2)
        output = log_path.read_text()
        if run.returncode != 0:
            raise RuntimeError(f"the run exited {run.returncode}:\n{output[-4000:]}")
        wall = time.perf_counter() - began
        rows = rows_of(run_dir)
        summary = json.loads((run_dir / "summary.json").read_text())
    finally:
        if run is not None and run.poll() is None:
            run.kill()
        kill(tree(processes_of(temp_dir)))
        shutil.rmtree(temp_dir, ignore_errors=True)
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
