"""benchmarks/rollout_replicas.py's arms run on today's code (issue 22: the hybrid arm broke silently for two
commits when the weight-sync strategy landed, because nothing ran it).

Each arm streams a few requests through a ReplicaPool, publishes one weight update mid-stream and reports what
the benchmark's JSON reports; the invariants asserted are the benchmark's own claims: every request finishes,
the update keeps every paused prefix (0 tokens regenerated) and some request spans two policy versions.
Requests of one length started together finish in the same step, and then none is live when the update is due;
so the test staggers their lengths (the benchmark's 16 in-flight requests stagger by arrival).
"""

from __future__ import annotations

import dataclasses
from argparse import Namespace

import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("rollout_replicas")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["standalone", "hybrid"])
def test_rollout_replicas_arm_runs_and_keeps_prefixes(bench, mode, ray_cluster, tmp_path):
    from async_rl.models.tiny import make_tiny_model

    model_path = str(make_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1))
    args = Namespace(requests=8, new_tokens=12, inflight=4, updates=1, chunk_tokens=2)

    class StaggeredLengths:  # hooks: called with the pool right before the timed stream
        staggered = 0

        def start(self, pool):
            submit = pool.add_requests

            def add_requests(requests):
                requests = list(requests)
                self.staggered += len(requests)
                submit([dataclasses.replace(r, sampling=dataclasses.replace(
                    r.sampling, max_new_tokens=r.sampling.max_new_tokens + 4 * (r.sampling.seed % 3)))
                    for r in requests])
            pool.add_requests = add_requests

        def stop(self, pool):
            pass

    hooks = StaggeredLengths()
    run = bench.run_one(model_path, 1, args, mode=mode, hooks=hooks)
    assert hooks.staggered == args.requests  # every timed request went through the staggering wrapper
    assert run["mode"] == mode and run["requests"] == 8 and run["updates"] == 1
    assert run["trajectories_per_s"] > 0 and run["tokens_per_s"] > 0
    # the update paused live requests mid-generation and kept what they had
    assert run["tokens_kept_across_updates"] > 0
    assert run["tokens_regenerated_after_update"] == 0
    assert run["requests_spanning_versions"] >= 1
