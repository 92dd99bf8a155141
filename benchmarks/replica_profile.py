"""Where the time goes with one and two hf rollout replicas, during ``rollout_replicas.py``'s timed request
stream only (after the warm-up; no start-up, no model loading).

For each replica count it runs ``rollout_replicas.run_one`` (``--requests`` requests of ``--new-tokens`` tokens, at
most ``--inflight`` live, ``--updates`` in-flight weight updates) and, between the start and the end of the
stream, (1) reads the CPU seconds (user + system, ``/proc/<pid>/stat``) of the driver and of every replica
process: the ground truth of who used the 2 cores; (2) samples the same processes with ``py-spy`` (nonblocking,
100 Hz, one stack per Python thread). A sample whose innermost frame is a wait (lock, condition, select, queue
get, Ray's main loop) counts as idle; every other sample is charged to the stage of its innermost frame that
names one: model forward (torch / transformers), engine (``rollout/hf_engine.py``: sampling, KV cache, per-token
bookkeeping), server (``rollout/servers/hf.py``, ``server_base.py``), pool (``rollout/pool.py``), Ray (``ray/``,
grpc, pickling), other. Each process's CPU seconds are split over the stages in proportion to its busy samples.

Run: ``.venv/bin/python benchmarks/replica_profile.py`` (as root, or with ptrace allowed for py-spy);
writes benchmarks/results/replica_profile.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, machine_info, quiet_libraries, set_threads  # noqa: E402

STAGES = (  # the innermost frame matching one of these decides
    # py-spy names files relative to site-packages ("Linear.forward (torch/nn/modules/linear.py:134)")
    ("model forward", re.compile(r"[(/](torch|transformers)/")),
    ("engine", re.compile(r"async_rl/rollout/hf_engine\.py")),
    ("server", re.compile(r"async_rl/rollout/(servers/|wire\.py)")),
    ("pool", re.compile(r"async_rl/rollout/pool\.py")),
    ("Ray", re.compile(r"([(/]ray/|grpc|pickle)")),
)
WAITS = re.compile(r"^(Condition\.wait|Event\.wait|_wait_for_tstate_lock|\w*[Ss]elector\.select|select |"
                   r"Worker\.main_loop|_worker \(concurrent/futures|get \(queue\.py|sleep|wait \(|"
                   r"Thread\.join|run_forever|_run_once)")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def stage_of(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, pattern in STAGES:
            if pattern.search(frame):
                return name
    return "other"


def busy_stages(raw: Path) -> collections.Counter:
    """Busy samples per stage in one py-spy raw file (``thread ...;frame;frame count`` lines)."""
    stages: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [f for f in stack.split(";") if f and not f.startswith(("process ", "thread "))]
        if not count.isdigit() or not frames or WAITS.match(frames[-1]):
            continue
        stages[stage_of(frames)] += int(count)
    return stages


class Profiler:
    """``rollout_replicas.run_one`` hooks: CPU times and py-spy samples of the driver and the replicas."""

    def __init__(self, py_spy: str, rate: int, tmp: Path):
        self.py_spy, self.rate, self.tmp = py_spy, rate, tmp
        self.result: dict = {}

    def start(self, pool) -> None:
        self.pids = {"driver": os.getpid(), **{f"replica {i}": int(pid) for i, pid in enumerate(pool.pids)}}
        self.cpu0 = {role: cpu_seconds(pid) for role, pid in self.pids.items()}
        self.spies = {role: subprocess.Popen(
            [self.py_spy, "record", "-p", str(pid), "-r", str(self.rate), "-f", "raw", "--threads", "--nonblocking",
             "-o", str(self.tmp / f"{role.replace(' ', '_')}.txt")], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL) for role, pid in self.pids.items()}
        time.sleep(0.5)  # py-spy attaches
        self.wall0 = time.perf_counter()

    def stop(self, pool) -> None:
        wall = time.perf_counter() - self.wall0
        cpu = {role: cpu_seconds(pid) - self.cpu0[role] for role, pid in self.pids.items()}
        processes = {}
        for role, spy in self.spies.items():
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)
            raw = self.tmp / f"{role.replace(' ', '_')}.txt"
            stages = busy_stages(raw) if raw.exists() else collections.Counter()
            busy = sum(stages.values())
            processes[role] = {"cpu_s": round(cpu[role], 2), "busy_samples": busy,
                               "cpu_s_by_stage": {k: round(cpu[role] * n / busy, 2) for k, n in stages.most_common()}
                               if busy else {}}
        total = collections.Counter()
        for p in processes.values():
            total.update(p["cpu_s_by_stage"])
        self.result = {"profiled_wall_s": round(wall, 3), "processes": processes,
                       "cpu_s_total": round(sum(cpu.values()), 2),
                       "cores_used_of_2": round(sum(cpu.values()) / wall, 2),
                       "cpu_s_by_stage": {k: round(v, 2) for k, v in total.most_common()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=960, help="long enough to sample (~6 s per arm)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--inflight", type=int, default=16)
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--chunk-tokens", type=int, default=4)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"))
    args = parser.parse_args()
    set_threads()
    quiet_libraries()
    import ray

    from async_rl.models.tiny import make_tiny_model
    from rollout_replicas import run_one

    ray.init(num_cpus=max(args.replicas) + 3, include_dashboard=False, log_to_driver=False)
    runs = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_path = str(make_tiny_model(Path(tmp) / "m"))
            for n in args.replicas:
                arm = Path(tmp) / f"arm{n}"
                arm.mkdir()
                profiler = Profiler(args.py_spy, args.rate, arm)
                run = run_one(model_path, n, args, hooks=profiler)
                runs.append({key: run[key] for key in ("replicas", "wall_s", "trajectories_per_s", "tokens_per_s",
                                                        "update_latency_s_median")} | profiler.result)
    finally:
        ray.shutdown()
    result = {"benchmark": "replica_profile", "settings": vars(args), "machine": machine_info(), "runs": runs}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "replica_profile.json").write_text(json.dumps(result, indent=2) + "\n")
    for run in runs:
        print(f"{run['replicas']} replica(s): {run['trajectories_per_s']} traj/s over {run['wall_s']} s; "
              f"{run['cores_used_of_2']} of 2 cores used; CPU s by stage {run['cpu_s_by_stage']}")
        for role, p in run["processes"].items():
            print(f"    {role}: {p['cpu_s']} CPU s, {p['cpu_s_by_stage']}")
    print(f"saved {RESULTS / 'replica_profile.json'}")


if __name__ == "__main__":
    main()
