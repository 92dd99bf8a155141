"""A Ray cluster started the way a user starts one: ``ray start --head`` and ``ray start --address=...`` (two nodes
on this machine, loopback only, each with its own custom resource), then the trainer's CLI joins it through
``RAY_ADDRESS``. The config pins rollout replica 0 to the head and replica 1 to the second node
(``rollout.replica_resources``). The second node has no CPU to offer, only its ``rollout_node`` resource, so the
train rank (which asks for a CPU) lands on the head, and the replicas reserve no CPU (``rollout.cpus_per_replica=0``).

Shown: the run trains on both replicas; after step 2 the test kills the second node's raylet and every process
under it, by pid; the run finishes all its steps on the head's replica, says one replica is alive, reports the loss
naming the replica, and keeps a readable checkpoint of every step after the loss. Every process the test started is
gone at the end (killed by pid: never ``ray stop``, which would stop other clusters on the machine).
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
TOTAL_STEPS = 6


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free ports in 7000-7499."""
    ports: list[int] = []
    for port in random.sample(range(7000, 7500), 500):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError("not enough free ports in 7000-7499")


def _processes_of(temp_dir: str, marker: str = "") -> set[int]:
    """The cluster's processes: every Ray process of it names its own ``--temp-dir`` on its command line (and
    ``marker`` too, when given). Processes of any other Ray cluster on the machine are never picked."""
    found = set()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            text = " ".join(proc.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if temp_dir in text and marker in text:
            found.add(proc.info["pid"])
    return found


def _tree(pids: set[int]) -> set[int]:
    out = set(pids)
    for pid in pids:
        try:
            out |= {child.pid for child in psutil.Process(pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    return out


def _kill(pids: set[int]) -> None:
    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


# `ray start --head` turns on token authentication (Ray's default): every joiner, the second node and the trainer
# alike, needs RAY_AUTH_MODE=token and the cluster's token. The test gives all three one through RAY_AUTH_TOKEN,
# so nothing is written to ~/.ray.
AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.urandom(16).hex()}


def _ray_start(*args: str) -> None:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **AUTH}
    done = subprocess.run([RAY, "start", *args, "--disable-usage-stats"], capture_output=True, text=True, env=env,
                          timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.fixture
def cluster(tmp_path):
    """``(address, second_node)``: a head (4 CPUs, ``head_node``) and a second node (no CPU, ``rollout_node``)
    started with the ``ray`` CLI; ``second_node()`` gives the second node's raylet (found by its resource) and every
    process under it. Every process of the cluster is killed by pid afterwards."""
    import shutil
    import tempfile

    # Ray's session files under a short folder of our own (unix socket paths are limited to 107 bytes): it names
    # this cluster's processes, and keeps its address file away from /tmp/ray, where any ray.init() would find it
    temp_dir = tempfile.mkdtemp(prefix="rs", dir="/tmp")
    port, client_port, agent_head, agent_second = _free_ports(4)

    def second_node() -> set[int]:
        raylets = {pid for pid in _processes_of(temp_dir, "rollout_node")
                   if "raylet" in " ".join(psutil.Process(pid).cmdline())}
        assert len(raylets) == 1, f"expected one raylet with the rollout_node resource, found {sorted(raylets)}"
        return _tree(raylets)

    try:
        _ray_start("--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=4",
                   "--resources={\"head_node\": 4}", "--include-dashboard=false",
                   f"--ray-client-server-port={client_port}", f"--dashboard-agent-listen-port={agent_head}",
                   f"--temp-dir={temp_dir}")
        _ray_start(f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.1", "--num-cpus=0",
                   "--resources={\"rollout_node\": 1}", f"--dashboard-agent-listen-port={agent_second}",
                   f"--temp-dir={temp_dir}")
        yield f"127.0.0.1:{port}", second_node
    finally:
        deadline = time.monotonic() + 30
        while True:
            everything = _tree(_processes_of(temp_dir))
            _kill(everything)
            if not _alive(everything) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not _alive(everything), f"processes the test started are still running: {_alive(everything)}"


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def test_the_cli_joins_a_ray_start_cluster_pins_a_replica_to_each_node_and_survives_losing_one(cluster, tmp_path,
                                                                                               tiny_model):
    address, second_node = cluster
    run_dir = tmp_path / "out" / "two-nodes"
    args = ["algorithm=grpo", "algorithm.train_batch_trajectories=8", "algorithm.group_size=4",
            "algorithm.actor_lr=1e-3", f"model.dir={tiny_model}", "model.build_tiny=false", "model.sft.enabled=false",
            f"trainer.output_dir={tmp_path / 'out'}", "trainer.run_name=two-nodes", "trainer.wandb=false",
            "trainer.export_model=false", "trainer.workers=ray", "trainer.scheduler=concurrent",
            f"trainer.driver.total_steps={TOTAL_STEPS}", "trainer.driver.checkpoint_every=1",
            "trainer.driver.keep_last=8", "trainer.driver.chunk_tokens=4", "env.max_new_tokens=6",
            "env.max_response_tokens=40", "rollout.replicas=2", "rollout.cpus_per_replica=0",
            "rollout.health_timeout_s=10", "rollout.replica_resources=[{head_node:1},{rollout_node:1}]"]
    env = {**os.environ, "RAY_ADDRESS": address, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **AUTH}
    log_path = tmp_path / "train_output.txt"  # a file, not a pipe: a pipe nobody reads would block the trainer
    killed_after = None
    with open(log_path, "w") as log:
        run = subprocess.Popen([sys.executable, "-m", "async_rl.train", *args], cwd=REPO, env=env, stdout=log,
                               stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 600
            while run.poll() is None and time.monotonic() < deadline:
                rows = _rows(run_dir)
                if killed_after is None and len(rows) >= 2:
                    killed_after = len(rows)
                    _kill(second_node())  # the second node's raylet, its agents and its workers (the replica)
                time.sleep(0.2)
        finally:
            if run.poll() is None:
                run.kill()
            run.wait()
    output = log_path.read_text()
    assert run.returncode == 0, output[-5000:]
    assert killed_after is not None and killed_after < TOTAL_STEPS
    rows = _rows(run_dir)
    assert [row["step"] for row in rows] == list(range(1, TOTAL_STEPS + 1))
    assert rows[0]["rollout/replicas_alive"] == 2.0  # both replicas served before the loss
    assert rows[-1]["rollout/replicas_alive"] == 1.0
    assert rows[-1]["trainer/policy_version"] == TOTAL_STEPS
    assert "rollout replica 1 (pid" in (run_dir / "train.log").read_text()  # the loss is reported, naming the replica
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == TOTAL_STEPS
    from async_rl.driver.checkpoint import list_checkpoints, read_checkpoint

    kept = [step for step, _ in list_checkpoints(run_dir / "checkpoints")]
    assert set(range(killed_after + 1, TOTAL_STEPS + 1)) <= set(kept)
    for step, path in list_checkpoints(run_dir / "checkpoints"):
        assert read_checkpoint(path)[1] is None, f"checkpoint of step {step} does not read back"
