"""LocalSandbox after the issue-21 hardening: how long run() takes to come back, and what the attacks get.

    .venv/bin/python benchmarks/sandbox_hardening.py      # ~3 min, as root with cgroups (like CI)

Measures, on this machine: ``print(1)`` latency (median of 10, seccomp filter included); a 2 s
``while True`` (return time); the inode flood (two processes creating empty files in ``/workdir`` until an
8 s deadline: files made, run() return time, background teardown time); the socket-buffer OOM reproducer
(error kind, OOM kills); a hostile run holding processes in one instance beside a 16-thread run in another
made from the same ``sandbox_uid``; the cost of the allowlist seccomp filter (issue 39): a typical ReTool
program (fractions, itertools, sympy), a numpy-heavy one and a syscall loop, each run 7 times with the
filter and 7 times with an allow-everything filter in its place, interleaved (wall time of ``run()`` and
the program's own time measured inside). Writes ``results/sandbox_hardening.json`` with the commit and a
dirty flag.
"""

from __future__ import annotations

import dataclasses
import statistics
import struct
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _common import machine_info, save_json  # noqa: E402
from test_sandbox_attacks import SOCKET_BUFFER_OOM  # noqa: E402  (the issue's reproducer, one copy)

from async_rl.sandbox import LocalSandbox, syscall_filter  # noqa: E402

FLOOD = (
    "import os\n"
    "os.fork()\n"
    "directory = os.open('.', os.O_RDONLY)\n"
    "os.mkdir(f'd{os.getpid()}', dir_fd=directory)\n"
    "directory = os.open(f'd{os.getpid()}', os.O_RDONLY, dir_fd=directory)\n"
    "count = 0\n"
    "while True:\n"
    "    os.mknod(str(count), dir_fd=directory)\n"
    "    count += 1\n"
    "    if count % 10000 == 0:\n"
    "        print(os.getpid(), count, flush=True)\n"
)
HOSTILE = (
    "import os, time\nheld = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(30)\n"
    "            os._exit(0)\n        held += 1\nexcept OSError:\n    print(held, flush=True)\ntime.sleep(30)\n"
)
GOOD = (
    "import threading\nthreads = [threading.Thread(target=sum, args=([1],)) for _ in range(16)]\n"
    "for thread in threads: thread.start()\nfor thread in threads: thread.join()\nprint('ok', len(threads))\n"
)


# what the filter costs: the program prints its own time from the start of its first import to its end
RETOOL_PROGRAM = (
    "import time\nstarted = time.perf_counter()\n"
    "import itertools, math\nfrom fractions import Fraction\nimport sympy as sp\n"
    "total = sum(Fraction(1, k) for k in range(1, 200))\n"
    "x = sp.symbols('x')\nroots = sp.solve(x**3 - 6*x**2 + 11*x - 6, x)\n"
    "count = sum(1 for p in itertools.permutations(range(8)) if p[0] < p[-1])\n"
    "print(roots, count, math.comb(50, 25) % 1000, total.denominator % 1000)\n"
    "print('elapsed', time.perf_counter() - started)\n"
)
NUMPY_PROGRAM = (
    "import time\nstarted = time.perf_counter()\nimport numpy as np\n"
    "rng = np.random.default_rng(0)\na = rng.standard_normal((300, 300))\n"
    "for _ in range(20):\n    a = np.linalg.qr(a @ a.T / 300 + np.eye(300))[0]\n"
    "spectrum = np.fft.rfft(rng.standard_normal(1 << 20))\nvalues = np.sort(rng.standard_normal(1 << 20))\n"
    "print(float(np.abs(spectrum).mean()), float(values[0]))\n"
    "print('elapsed', time.perf_counter() - started)\n"
)
SYSCALL_LOOP = (
    "import os, time\nstarted = time.perf_counter()\n"
    "for _ in range(200000):\n    os.getppid()\n"
    "print('elapsed', time.perf_counter() - started)\n"
)
ALLOW_EVERYTHING = struct.pack("<HBBI", 0x06, 0, 0, 0x7FFF0000)  # BPF "ret SECCOMP_RET_ALLOW"


def filter_cost(sandbox: LocalSandbox, repeats: int = 7) -> dict:
    """Median run() wall time and in-program time, allowlist vs allow-everything, interleaved."""
    allowlist = sandbox._capabilities
    permissive = dataclasses.replace(allowlist, seccomp_program=ALLOW_EVERYTHING)
    costs = {}
    for name, code in (("retool_sympy", RETOOL_PROGRAM), ("numpy_heavy", NUMPY_PROGRAM),
                       ("getppid_x200k", SYSCALL_LOOP)):
        samples: dict[str, dict[str, list[float]]] = {"allowlist": {"wall": [], "inside": []},
                                                      "allow_everything": {"wall": [], "inside": []}}
        for _ in range(repeats):
            for label, capabilities in (("allowlist", allowlist), ("allow_everything", permissive)):
                sandbox._capabilities = capabilities
                result, returned, _ = timed(sandbox, code, 60)
                assert result.ok, result
                samples[label]["wall"].append(returned)
                samples[label]["inside"].append(float(result.stdout.split("elapsed")[-1]))
        sandbox._capabilities = allowlist
        medians = {label: {kind: round(statistics.median(values), 4) for kind, values in kinds.items()}
                   for label, kinds in samples.items()}
        medians["inside_overhead_pct"] = round(
            100 * (medians["allowlist"]["inside"] / medians["allow_everything"]["inside"] - 1), 1)
        costs[name] = medians
    return costs


def timed(sandbox: LocalSandbox, code: str, timeout_s: float):
    started = time.monotonic()
    result = sandbox.run(code, timeout_s=timeout_s)
    returned = time.monotonic() - started
    sandbox.wait_idle(120)
    return result, returned, time.monotonic() - started


def flood_files(stdout: str) -> int:
    last: dict[str, int] = {}
    for line in stdout.split("\n"):
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            last[parts[0]] = int(parts[1])
    return sum(last.values())


def main() -> None:
    machine = machine_info()  # git_commit and git_dirty (_common.git_provenance: tracked code only)
    sandbox = LocalSandbox(timeout_s=10, memory_limit_mb=1024, max_processes=64, max_concurrency=1, sandbox_uid=65400,
                           sandbox_gid=65400)
    isolation = sandbox.isolation
    latencies = [timed(sandbox, "print(1)", 10)[1] for _ in range(10)]
    costs = filter_cost(sandbox)
    loop, loop_returned, _ = timed(sandbox, "while True:\n    pass", 2)
    floods = []
    for _ in range(2):
        result, returned, idle = timed(sandbox, FLOOD, 8)
        floods.append({"error_kind": result.error_kind, "files": flood_files(result.stdout),
                       "run_returned_s": round(returned, 3), "teardown_done_s": round(idle, 3),
                       "cleanup_error": result.cleanup_error})
    oom_box = LocalSandbox(timeout_s=20, memory_limit_mb=512, max_concurrency=1, sandbox_uid=65400, sandbox_gid=65400)
    oom, oom_returned, _ = timed(oom_box, SOCKET_BUFFER_OOM, 20)
    hostile_box = LocalSandbox(timeout_s=6, max_processes=64, max_concurrency=1, sandbox_uid=65400, sandbox_gid=65400)
    good_box = LocalSandbox(timeout_s=20, max_processes=64, max_concurrency=1, sandbox_uid=65400, sandbox_gid=65400)
    results = {}
    runner = threading.Thread(target=lambda: results.setdefault("hostile", hostile_box.run(HOSTILE)))
    runner.start()
    time.sleep(2.5)
    good = good_box.run(GOOD)
    runner.join(60)
    payload = {
        "benchmark": "sandbox_hardening",
        "machine": machine,
        "isolation": {"memory_scope": isolation.memory_scope, "privileges_dropped": isolation.privileges_dropped,
                      "seccomp_refused": len(isolation.seccomp), "bwrap": sandbox._capabilities.bwrap_version,
                      "seccomp_allowed": len(syscall_filter.build_program()[1]["allowed"]),
                      "seccomp_instructions": len(sandbox._capabilities.seccomp_program) // 8,
                      "oom_floor": sandbox._capabilities.oom_floor},
        "print_1_latency_s": {"median": round(statistics.median(latencies), 3), "max": round(max(latencies), 3)},
        "seccomp_filter_cost": costs,
        "infinite_loop_2s": {"error_kind": loop.error_kind, "run_returned_s": round(loop_returned, 3)},
        "inode_flood_8s": floods,
        "socket_buffer_oom_512mb": {"error_kind": oom.error_kind, "detail": oom.detail,
                                    "run_returned_s": round(oom_returned, 3)},
        "two_instances_same_sandbox_uid": {
            "uids": [list(hostile_box.slot_uids), list(good_box.slot_uids)],
            "hostile_processes_held": int(results["hostile"].stdout.split()[0]),
            "hostile_error_kind": results["hostile"].error_kind,
            "good_run": {"ok": good.ok, "stdout": good.stdout.strip(), "error_kind": good.error_kind},
        },
    }
    for box in (sandbox, oom_box, hostile_box, good_box):
        box.close()
    path = save_json("sandbox_hardening", payload)
    print(f"print(1) median {payload['print_1_latency_s']['median']} s; 2 s loop back after {loop_returned:.2f} s")
    for name, cost in costs.items():
        print(f"filter cost {name}: {cost}")
    for flood in floods:
        print(f"inode flood: {flood['files']} files, run() back after {flood['run_returned_s']} s, "
              f"teardown done after {flood['teardown_done_s']} s")
    print(f"socket-buffer OOM: {oom.error_kind} ({oom.detail}); two instances: good run {good.stdout.strip()!r} "
          f"beside {payload['two_instances_same_sandbox_uid']['hostile_processes_held']} hostile processes")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
