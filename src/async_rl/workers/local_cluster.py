"""A Ray cluster of several nodes on this one machine, started the way a user starts one: the ``ray`` CLI.

For trying multi-node behaviour without a second machine (``tests/test_ray_start_cluster.py``,
``benchmarks/two_node_run.py``): ``ray start --head``, then ``ray start --address=...`` per extra node, each node
with its own custom resources, loopback only. Every node keeps its session files under one short folder of its own
(``--temp-dir``): that folder names each process of this cluster on its command line, so :meth:`close` and
:meth:`kill_node` kill by pid exactly this cluster's processes (never ``ray stop``, which would stop every Ray
cluster on the machine), and this cluster's address file stays away from ``/tmp/ray``, where any ``ray.init()``
would find it.

``ray start --head`` turns on token authentication (the default of Ray 2.60): :attr:`env` carries
``RAY_AUTH_MODE=token`` and a random ``RAY_AUTH_TOKEN`` for every node and for the driver that joins
(``RAY_ADDRESS=<address>``), so nothing is written to ``~/.ray``.

    with LocalRayCluster() as cluster:
        cluster.add_node(num_cpus=0, resources={"rollout_node": 1})
        subprocess.run([...], env={**os.environ, **cluster.env, "RAY_ADDRESS": cluster.address})
        cluster.kill_node("rollout_node")   # its raylet and every process under it
"""

from __future__ import annotations

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
from typing import Mapping, Optional

import psutil


def free_ports(count: int, low: int = 7000, high: int = 8000) -> list[int]:
    """``count`` distinct ports in ``[low, high)`` that nothing listens on (probed one by one)."""
    ports: list[int] = []
    for port in random.sample(range(low, high), high - low):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"not {count} free ports in {low}-{high - 1}")


def process_tree(pids: set[int]) -> set[int]:
    """``pids`` and every process under them."""
    out = set(pids)
    for pid in pids:
        try:
            out |= {child.pid for child in psutil.Process(pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    return out


def kill_processes(pids: set[int]) -> None:
    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (a zombie has finished)."""
    running = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.add(pid)
        except psutil.NoSuchProcess:
            pass
    return running


def processes_naming(text: str) -> set[int]:
    """Processes whose command line contains ``text``."""
    found = set()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if text in " ".join(proc.info["cmdline"] or []):
                found.add(proc.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


class LocalRayCluster:
    """A head node (``head_cpus`` CPUs and ``head_resources``) started with ``ray start --head``; more nodes with
    :meth:`add_node`. ``address`` and ``env`` (token authentication) are what a driver needs to join it."""

    def __init__(self, head_cpus: int = 4, head_resources: Optional[Mapping[str, float]] = None,
                 timeout_s: float = 180.0):
        self.temp_dir = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # short: unix socket paths are limited to 107 B
        self.env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.urandom(16).hex()}
        self.timeout_s = timeout_s
        port, client_port, agent_port = free_ports(3)
        self.address = f"127.0.0.1:{port}"
        try:
            self._ray_start("--head", f"--port={port}", f"--num-cpus={head_cpus}",
                            f"--resources={json.dumps(dict(head_resources or {}))}", "--include-dashboard=false",
                            f"--ray-client-server-port={client_port}", f"--dashboard-agent-listen-port={agent_port}")
        except BaseException:
            self.close()
            raise

    def _ray_start(self, *args: str) -> None:
        ray = str(Path(sys.executable).with_name("ray"))
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **self.env}
        done = subprocess.run([ray, "start", *args, "--node-ip-address=127.0.0.1", f"--temp-dir={self.temp_dir}",
                               "--disable-usage-stats"], capture_output=True, text=True, env=env,
                              timeout=self.timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"ray start {' '.join(args)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")

    def add_node(self, num_cpus: int, resources: Mapping[str, float]) -> None:
        """Start one more node (its own raylet) with ``num_cpus`` CPUs and ``resources``; the first resource name
        identifies it to :meth:`kill_node`."""
        (agent_port,) = free_ports(1)
        self._ray_start(f"--address={self.address}", f"--num-cpus={num_cpus}",
                        f"--resources={json.dumps(dict(resources))}", f"--dashboard-agent-listen-port={agent_port}")

    def processes(self) -> set[int]:
        """Every process of this cluster, workers included."""
        return process_tree(processes_naming(self.temp_dir))

    def node_processes(self, resource: str) -> set[int]:
        """The node started with ``resource``: its raylet and every process under it (agents, workers)."""
        raylets = {pid for pid in processes_naming(self.temp_dir) & processes_naming(resource)
                   if "raylet" in " ".join(_cmdline(pid))}
        if len(raylets) != 1:
            raise RuntimeError(f"expected one raylet started with the resource {resource!r}, found {sorted(raylets)}")
        return process_tree(raylets)

    def kill_node(self, resource: str) -> set[int]:
        """Kill the node started with ``resource`` (SIGKILL, by pid), as a machine lost; returns the pids."""
        pids = self.node_processes(resource)
        kill_processes(pids)
        return pids

    def close(self, wait_s: float = 30.0) -> set[int]:
        """Kill every process of the cluster by pid and remove its folder; returns those still running after
        ``wait_s`` (empty when all are gone)."""
        deadline = time.monotonic() + wait_s
        while True:
            everything = self.processes()
            kill_processes(everything)
            if not alive(everything) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return alive(everything)

    def __enter__(self) -> "LocalRayCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.NoSuchProcess:
        return []
