"""A Ray cluster started the way a user starts one: ``ray start --head`` and ``ray start --address=...`` (two nodes
on this machine, loopback only, token authentication, each with its own custom resource:
``async_rl.workers.local_cluster.LocalRayCluster``), then the trainer's CLI joins it through ``RAY_ADDRESS``. The
config pins rollout replica 0 to the head and replica 1 to the second node (``rollout.replica_resources``). The
second node has no CPU to offer, only its ``rollout_node`` resource, so the train rank (which asks for a CPU) lands
on the head, and the replicas reserve no CPU (``rollout.cpus_per_replica=0``).

Shown: the run trains on both replicas; after step 2 the test kills the second node's raylet and every process
under it, by pid; the run finishes all its steps on the head's replica, says one replica is alive, reports the loss
naming the replica, and keeps a readable checkpoint of every step after the loss. Then a new second node joins and
``trainer.resume=true`` continues the run from its last checkpoint to more steps, on both nodes again. Every process
of the cluster is gone at the end (found by its own temp dir and killed by pid: never ``ray stop``, which would stop
other clusters).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from async_rl.workers.local_cluster import LocalRayCluster

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[1]
TOTAL_STEPS = 6


@pytest.fixture
def cluster():
    """A head (4 CPUs, ``head_node``) and a second node (no CPU, ``rollout_node``), all gone afterwards."""
    cluster = LocalRayCluster(head_cpus=4, head_resources={"head_node": 4})
    try:
        cluster.add_node(num_cpus=0, resources={"rollout_node": 1})
        yield cluster
    finally:
        left = cluster.close()
        assert not left, f"processes of the test's cluster are still running: {sorted(left)}"


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _train(args, env, log_path, run_dir, on_rows=None, timeout_s=600):
    """Run the trainer CLI to its end (its output to a file: a pipe nobody reads would block it); ``on_rows(rows)``
    is called with the metrics logged so far while it runs."""
    with open(log_path, "w") as log:
        run = subprocess.Popen([sys.executable, "-m", "async_rl.train", *args], cwd=REPO, env=env, stdout=log,
                               stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + timeout_s
            while run.poll() is None and time.monotonic() < deadline:
                if on_rows is not None:
                    on_rows(_rows(run_dir))
                time.sleep(0.2)
        finally:
            if run.poll() is None:
                run.kill()
            run.wait()
    return run, log_path.read_text()


def test_the_cli_joins_a_ray_start_cluster_pins_a_replica_to_each_node_and_survives_losing_one(cluster, tmp_path,
                                                                                               tiny_model):
    run_dir = tmp_path / "out" / "two-nodes"
    args = ["algorithm=grpo", "algorithm.train_batch_trajectories=8", "algorithm.group_size=4",
            "algorithm.actor_lr=1e-3", f"model.dir={tiny_model}", "model.build_tiny=false", "model.sft.enabled=false",
            f"trainer.output_dir={tmp_path / 'out'}", "trainer.run_name=two-nodes", "trainer.wandb=false",
            "trainer.export_model=false", "trainer.workers=ray", "trainer.scheduler=concurrent",
            f"trainer.driver.total_steps={TOTAL_STEPS}", "trainer.driver.checkpoint_every=1",
            "trainer.driver.keep_last=8", "trainer.driver.chunk_tokens=4", "env.max_new_tokens=6",
            "env.max_response_tokens=40", "rollout.replicas=2", "rollout.cpus_per_replica=0",
            "rollout.health_timeout_s=10", "rollout.replica_resources=[{head_node:1},{rollout_node:1}]"]
    env = {**os.environ, **cluster.env, "RAY_ADDRESS": cluster.address, "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "offline"}
    killed = []

    def kill_second_node_after_step_2(rows):
        if not killed and len(rows) >= 2:
            killed.append(len(rows))
            cluster.kill_node("rollout_node")  # its raylet, its agents and its workers (the replica)

    run, output = _train(args, env, tmp_path / "train_output.txt", run_dir, kill_second_node_after_step_2)
    killed_after = killed[0] if killed else None
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

    # a new second node joins; the run resumes from its last checkpoint and trains 3 more steps on both nodes
    cluster.add_node(num_cpus=0, resources={"rollout_node": 1})
    more = [a for a in args if not a.startswith("trainer.driver.total_steps=")]
    resumed, output = _train([*more, f"trainer.driver.total_steps={TOTAL_STEPS + 3}", "trainer.resume=true"], env,
                             tmp_path / "resume_output.txt", run_dir)
    assert resumed.returncode == 0, output[-5000:]
    assert f"step_{TOTAL_STEPS:06d}.pt at step {TOTAL_STEPS}" in output
    rows = _rows(run_dir)
    assert [row["step"] for row in rows] == list(range(1, TOTAL_STEPS + 4))  # every step once
    assert all(row["rollout/replicas_alive"] == 2.0 for row in rows[TOTAL_STEPS:])  # both nodes serve again
    assert rows[-1]["trainer/policy_version"] == TOTAL_STEPS + 3
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == TOTAL_STEPS + 3
