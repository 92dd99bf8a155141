"""Start-up and hand-off costs the docs quote: a thread per call vs a hand-off to a persistent
:class:`~async_rl.envs.calls.EnvCallPool` worker (docs/driver.md), the local code sandbox's run of
``print(1)`` and a math-verifier worker's start (docs/tasks.md).

Each cost is the median (and 10th / 90th percentiles) of repeated measurements on this machine; the load
average is saved next to them. Saves ``results/call_costs.json`` with machine info, commit and dirty flag.

Run: ``.venv/bin/python benchmarks/call_costs.py`` (~30 s; the sandbox row needs bubblewrap, else it is
recorded as unavailable with the reason).
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def _stats(samples: list[float]) -> dict:
    s = sorted(samples)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {"n": len(s), "median_s": statistics.median(s), "p10_s": pick(0.1), "p90_s": pick(0.9)}


def thread_per_call(n: int = 500) -> dict:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()
        out.append(time.perf_counter() - t0)
    return _stats(out)


def pool_hand_off(n: int = 500) -> dict:
    from async_rl.envs.calls import EnvCallPool

    pool = EnvCallPool()
    pool.call(lambda: None, timeout_s=5.0)  # the first call starts the worker
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        finished, _, error, refused = pool.call(lambda: None, timeout_s=5.0)
        out.append(time.perf_counter() - t0)
        assert finished and error is None and refused is None
    return _stats(out)


def sandbox_print(n: int = 10) -> dict:
    try:
        from async_rl.sandbox.local import LocalSandbox

        box = LocalSandbox()
        box.run("print(1)")  # warm-up
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            result = box.run("print(1)")
            out.append(time.perf_counter() - t0)
        return {**_stats(out), "stdout": getattr(result, "stdout", None)}
    except Exception as exc:  # noqa: BLE001 - recorded, not hidden
        return {"unavailable": f"{type(exc).__name__}: {exc}"}


def verifier_start(n: int = 3) -> dict:
    from async_rl.rewards.math_reward import MathVerifier

    out = []
    for _ in range(n):
        verifier = MathVerifier(max_workers=1)
        t0 = time.perf_counter()
        started = verifier.warm_up(1)
        out.append(time.perf_counter() - t0)
        verifier.close()
        assert started == 1, "the verifier worker did not start"
    return _stats(out)


def main() -> dict:
    machine = C.machine_info()
    result = {"benchmark": "call_costs", "thread_per_call": thread_per_call(), "pool_hand_off": pool_hand_off(),
              "sandbox_print_1": sandbox_print(), "math_verifier_worker_start": verifier_start(),
              "machine": machine}
    for key in ("thread_per_call", "pool_hand_off", "sandbox_print_1", "math_verifier_worker_start"):
        r = result[key]
        print(f"{key:28s} " + (r["unavailable"] if "unavailable" in r else
                               f"median {r['median_s'] * 1e3:8.3f} ms (p10 {r['p10_s'] * 1e3:.3f}, "
                               f"p90 {r['p90_s'] * 1e3:.3f})"))
    print(f"saved {C.save_json('call_costs', result)}")
    return result


if __name__ == "__main__":
    main()
