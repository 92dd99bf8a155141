"""Rollout replicas (hf engine, each its own Ray actor process): throughput with 1 and 2 replicas, in-flight
weight-update latency, and tokens regenerated after an update (must be 0).

For each replica count (standalone), and for one hybrid replica inside one train rank (``rollout.mode=hybrid``,
where each publication follows a change of the actor's weights and copies them in memory), it streams ``--requests`` single-turn requests (``--new-tokens`` tokens each, eos
ignored, at most ``--inflight`` live at once: a finished request is replaced at once, as the driver does) through
a :class:`~async_rl.rollout.pool.ReplicaPool` and reports requests ("trajectories") per second and tokens per
second. Meanwhile the driver publishes new weights ``--updates`` times: each publication pauses every replica,
reads every live request's tokens at the pause (``HFRolloutServer.progress``), loads the new version and resumes;
its wall time is the in-flight update latency. At the end every paused prefix is compared with the request's
final tokens: a token that differs (or is missing) was regenerated.

A second part compares the concurrent scheduler's staleness-aware admission and stale aborts with the loop
without them (``ConcurrentDriver(staleness_aware=False)``, what the scheduler did before) on the same config
(GRPO, toy_keys, in-driver engine, ``--cap``): trajectories dropped stale at batch time, live episodes aborted
stale, the model tokens those cost, and the largest trained lag (<= cap either way).

On this 2-core box two replicas compete for the same cores as the driver, so the 2-replica speed-up is
bounded by the machine, not by the design; the JSON records the machine.

Run: ``.venv/bin/python benchmarks/rollout_replicas.py [--requests 96] [--new-tokens 32] [--updates 4]``
Saves benchmarks/results/rollout_replicas.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, machine_info, quiet_libraries, set_threads  # noqa: E402

RESULTS_PATH = RESULTS / "rollout_replicas.json"


def perturbed_weights(model_path: str, seed: int) -> dict[str, torch.Tensor]:
    from async_rl.models.loading import load_causal_lm

    generator = torch.Generator().manual_seed(seed)
    model = load_causal_lm(model_path, device="cpu")
    return {name: t + 0.01 * torch.randn(t.shape, generator=generator) for name, t in model.state_dict().items()}


def run_one(model_path: str, replicas: int, args, mode: str = "standalone", hooks=None) -> dict:
    """One arm. ``hooks`` (optional) gets ``start(pool)`` after the warm-up, right before the timed stream, and
    ``stop(pool)`` right after it (``replica_profile.py`` samples the processes in between)."""
    import ray

    from async_rl.rollout.base import GenerationRequest, SamplingParams
    from async_rl.rollout.checkpoint_engine import in_process_handle, published_handle
    from async_rl.rollout.launch import launch_replicas
    from async_rl.rollout.pool import ReplicaPool
    from async_rl.workers.placement import make_worker_groups

    groups = None
    if mode == "hybrid":  # one train rank (actor + fused rollout engine) per replica; the trainer's weights change
        groups = make_worker_groups("colocated", replicas, None, model_path, with_critic=False)
        pool = ReplicaPool(launch_replicas("hf", replicas, model_path, chunk_tokens=args.chunk_tokens, mode="hybrid",
                                           worker_group=groups.process_groups[0]), "hf")
    else:
        pool = ReplicaPool(launch_replicas("hf", replicas, model_path, chunk_tokens=args.chunk_tokens), "hf")
    updates = [perturbed_weights(model_path, seed) for seed in range(1, args.updates + 1)]
    handles = [published_handle(v, ray.put(w)) for v, w in enumerate(updates, start=1)]
    generator = torch.Generator().manual_seed(0)

    def request(i: int) -> GenerationRequest:
        prompt = torch.randint(16, 500, (int(torch.randint(8, 33, (1,), generator=generator)),),
                               generator=generator).tolist()
        return GenerationRequest(f"p{i}/r0/turn0", prompt, SamplingParams(max_new_tokens=args.new_tokens, seed=i,
                                                                          ignore_eos=True))

    try:
        pool.generate([request(-1 - r) for r in range(2 * replicas)])  # warm-up: every replica prefills once
        submitted, finished, snapshots, latencies = 0, {}, [], []
        # publish when these many requests have finished: spread over the run
        due = [round(args.requests * (k + 1) / (args.updates + 1)) for k in range(args.updates)]
        if hooks is not None:
            hooks.start(pool)
        started = time.perf_counter()
        while len(finished) < args.requests:
            while submitted < args.requests and pool.num_unfinished < args.inflight:
                pool.add_requests([request(submitted)])
                submitted += 1
            for output in pool.step():
                finished[output.request_id] = output
            if due and len(finished) >= due[0]:
                due.pop(0)
                version = len(latencies) + 1
                if groups is not None:  # hybrid: a training step changes the actor's weights in the same process
                    groups.remote_actor().load_state_dict({"model": updates[version - 1]})
                t0 = time.perf_counter()
                # pause first to read the exact prefixes that the update must keep, then publish
                ray.get([r.servers[0].abort_all_requests.remote() for r in pool.replicas])
                for r in pool.replicas:
                    snapshots += list(ray.get(r.servers[0].progress.remote()).items())
                # the one form this pool takes (rollout/publication.py): hybrid replicas copy the weights from
                # the actor in their own process and are sent only the version; standalone ones get the handle
                pool.update_weights(in_process_handle(version) if groups is not None else handles[version - 1],
                                    version)
                latencies.append(time.perf_counter() - t0)
        elapsed = time.perf_counter() - started
        if hooks is not None:
            hooks.stop(pool)
    finally:
        pool.shutdown()
        if groups is not None:
            groups.shutdown()
    kept = sum(len(state["token_ids"]) for _, state in snapshots)
    regenerated = sum(sum(1 for i, t in enumerate(state["token_ids"])
                          if i >= len(finished[rid].token_ids) or finished[rid].token_ids[i] != t)
                      for rid, state in snapshots)
    tokens = sum(len(o.token_ids) for o in finished.values())
    multi_version = sum(1 for o in finished.values() if len(set(o.versions)) >= 2)
    return {
        "replicas": replicas, "mode": mode, "pids": pool.pids, "requests": args.requests, "wall_s": round(elapsed, 3),
        "trajectories_per_s": round(args.requests / elapsed, 2), "tokens_per_s": round(tokens / elapsed, 1),
        "updates": len(latencies), "update_latency_s_median": round(statistics.median(latencies), 4),
        "update_latency_s_max": round(max(latencies), 4), "tokens_kept_across_updates": kept,
        "tokens_regenerated_after_update": regenerated, "requests_spanning_versions": multi_version,
        "resubmitted": pool.counters["resubmitted"],
    }


def admission_comparison(model_path: str, args) -> list[dict]:
    """The concurrent driver with and without staleness-aware admission, same seed and config."""
    import async_rl.envs.toy  # noqa: F401
    from async_rl.config import AlgorithmConfig
    from async_rl.assemble import RunSpec, build_learner_and_rollout
    from async_rl.driver.concurrent import ConcurrentDriver
    from async_rl.driver.driver import DriverConfig
    from async_rl.driver.episode import EpisodeLimits
    from async_rl.envs.toy import make_toy_tasks

    rows = []
    for admission in (False, True):
        algo = AlgorithmConfig(name="grpo", train_batch_trajectories=16, group_size=4, actor_lr=1e-3)
        spec = RunSpec(model_path=model_path, env_name="toy_keys", tasks=make_toy_tasks("toy_keys", 256, 0),
                       max_new_tokens=8, limits=EpisodeLimits(max_turns=3, max_response_tokens=64))
        learner, rollout = build_learner_and_rollout(algo, spec)
        driver = ConcurrentDriver(DriverConfig(total_steps=args.admission_steps, staleness_cap=args.cap,
                                               chunk_tokens=4, max_inflight_trajectories=64), learner, rollout,
                                  staleness_aware=admission)
        history = driver.run()
        dropped = driver.buffer.counters.dropped_stale
        rows.append({"admission": admission, "steps": len(history), "dropped_stale": dropped,
                     "aborted_stale": driver.aborted_stale, "stale_aborted_tokens": driver.stale_wasted_tokens,
                     "max_trained_lag": max(m["async/policy_lag/max"] for m in history),
                     "mean_trained_lag": round(statistics.fmean(m["async/policy_lag/mean"] for m in history), 3),
                     "wall_s": round(history[-1]["perf/wall_s"], 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--inflight", type=int, default=16)
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--chunk-tokens", type=int, default=4)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--no-hybrid", dest="hybrid", action="store_false",
                        help="skip the rollout.mode=hybrid arm (1 replica inside 1 train rank)")
    parser.add_argument("--cap", type=int, default=1, help="staleness cap of the admission comparison")
    parser.add_argument("--admission-steps", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    set_threads()
    quiet_libraries()
    import ray

    from async_rl.models.tiny import make_tiny_model

    ray.init(num_cpus=max(args.replicas) + 3, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_path = str(make_tiny_model(Path(tmp) / "m"))
            runs = [run_one(model_path, n, args) for n in args.replicas]
            runs += [run_one(model_path, 1, args, mode="hybrid")] if args.hybrid else []
            admission = admission_comparison(model_path, args)
    finally:
        ray.shutdown()
    result = {"benchmark": "rollout_replicas", "settings": {k: (str(v) if isinstance(v, Path) else v)
                                                          for k, v in vars(args).items()},
              "machine": machine_info(), "runs": runs, "admission": admission}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for run in runs:
        print(f"{run['replicas']} {run['mode']} replica(s): {run['trajectories_per_s']} traj/s, {run['tokens_per_s']} tok/s, "
              f"update latency median {run['update_latency_s_median']} s (max {run['update_latency_s_max']}), "
              f"kept {run['tokens_kept_across_updates']} tokens, regenerated {run['tokens_regenerated_after_update']}, "
              f"{run['requests_spanning_versions']} requests span >= 2 versions")
    for row in admission:
        print(f"staleness-aware {'on ' if row['admission'] else 'off'} (cap {args.cap}): "
              f"dropped stale {row['dropped_stale']}, "
              f"aborted stale {row['aborted_stale']} ({row['stale_aborted_tokens']} tokens), trained lag max "
              f"{row['max_trained_lag']:.0f} mean {row['mean_trained_lag']}, {row['wall_s']} s")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
