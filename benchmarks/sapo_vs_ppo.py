"""SAPO (one backbone: policy + V + Q) vs PPO with a separate critic: memory and time per iteration.

Same tiny model family, same task (toy_keys), same steps and batch. Each algorithm runs in its own
subprocess, and its peak resident memory is that process's own ``VmHWM`` (/proc/self/status: the high-water mark
of the address space ``exec`` gave it). ``ru_maxrss`` is not used: a child started by ``subprocess`` keeps the
maximum of the forked parent's copy across ``exec``, so both arms recorded the parent's peak (issue 35). Model-state bytes count parameters, gradients
and optimizer states of every *trained* model (SAPO: the policy; PPO: actor + critic); ``all_copies_bytes``
adds every other copy either method keeps: SAPO's frozen reference policy for the KL term and the rollout
engine's copy of the policy (parameters and buffers).
Prints ratios and saves JSON to benchmarks/results/sapo_vs_ppo.json (another size: sapo_vs_ppo_h<H>_l<L>.json).

    .venv/bin/python benchmarks/sapo_vs_ppo.py [--steps 20] [--hidden-size 128] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_provenance  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _own_peak_rss_bytes() -> int:
    """This process's peak resident set since its ``exec`` (``VmHWM``), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line (Linux only)")


def run_one(algo: str, model_dir: str, steps: int) -> dict:
    import torch

    import async_rl.envs.toy  # noqa: F401
    from async_rl.config import AlgorithmConfig
    from async_rl.assemble import RunSpec, build_deterministic_driver
    from async_rl.driver.driver import DriverConfig
    from async_rl.driver.episode import EpisodeLimits
    from async_rl.envs.toy import make_toy_tasks

    torch.set_num_threads(1)
    if algo == "sapo":
        cfg = AlgorithmConfig(name="sapo", train_batch_trajectories=32, group_size=1, actor_lr=1e-3)
    else:
        cfg = AlgorithmConfig(name="ppo", train_batch_trajectories=32, group_size=1, use_critic=True, actor_lr=1e-3,
                              critic_lr=1e-3, gae_lambda=0.95, critic_updates_per_batch=1,
                              freeze_critic_attention=False)
    spec = RunSpec(model_path=model_dir, env_name="toy_keys", tasks=make_toy_tasks("toy_keys", 256, 0),
                   max_new_tokens=24, limits=EpisodeLimits(max_turns=4, max_response_tokens=160))
    driver = build_deterministic_driver(cfg, DriverConfig(total_steps=steps, max_inflight_trajectories=32), spec)
    learner = driver.learner
    step_times = []
    original = learner.train_step

    def timed(batch):
        t0 = time.perf_counter()
        out = original(batch)
        step_times.append(time.perf_counter() - t0)
        return out

    learner.train_step = timed
    t0 = time.perf_counter()
    history = driver.run()
    wall = time.perf_counter() - t0
    engines = [learner.actor.engine] + ([learner.critic.engine] if learner.critic is not None else [])
    state_bytes = sum(e.model_state_bytes() for e in engines)
    ref = getattr(learner.actor, "ref_model", None)
    ref_bytes = sum(p.numel() * p.element_size() for p in ref.parameters()) if ref is not None else 0
    engine_model = getattr(driver.rollout.engine, "model", None)
    rollout_bytes = (sum(t.numel() * t.element_size() for t in [*engine_model.parameters(), *engine_model.buffers()])
                     if engine_model is not None else 0)
    return {
        "algo": algo,
        "model_state_bytes": state_bytes,
        "reference_param_bytes": ref_bytes,
        "rollout_copy_bytes": rollout_bytes,
        "all_copies_bytes": state_bytes + ref_bytes + rollout_bytes,
        "trained_models": len(engines),
        "peak_rss_bytes": _own_peak_rss_bytes(),
        "train_s_per_iter": sum(step_times[1:]) / max(len(step_times) - 1, 1),  # first step warms up
        "wall_s_per_iter": wall / steps,
        "final_success": sum(m["train/success_rate"] for m in history[-5:]) / 5,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--worker", choices=["sapo", "ppo"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_one(args.worker, args.model, args.steps)))
        return

    from async_rl.models.sft import sft_warm_start
    from async_rl.models.tiny import make_tiny_model

    root = Path("outputs/bench_models") / f"tiny-h{args.hidden_size}-l{args.layers}"
    if not (root / "sft" / "config.json").exists():
        make_tiny_model(root / "base", hidden_size=args.hidden_size, num_layers=args.layers,
                        intermediate_size=2 * args.hidden_size)
        sft_warm_start(root / "base", root / "sft", env_name="toy_keys", seed=0)
    results = {}
    for algo in ("sapo", "ppo"):
        out = subprocess.run([sys.executable, __file__, "--worker", algo, "--model", str(root / "sft"),
                              "--steps", str(args.steps)], capture_output=True, text=True, check=True)
        results[algo] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{algo:>5}: state {results[algo]['model_state_bytes'] / 2**20:7.2f} MiB, "
              f"peak RSS {results[algo]['peak_rss_bytes'] / 2**20:7.1f} MiB, "
              f"train {results[algo]['train_s_per_iter'] * 1e3:7.1f} ms/iter, "
              f"wall {results[algo]['wall_s_per_iter'] * 1e3:7.1f} ms/iter")
    s, p = results["sapo"], results["ppo"]
    ratios = {
        "model_state_bytes": s["model_state_bytes"] / p["model_state_bytes"],
        "all_copies_bytes": s["all_copies_bytes"] / p["all_copies_bytes"],
        "peak_rss_bytes": s["peak_rss_bytes"] / p["peak_rss_bytes"],
        "train_s_per_iter": s["train_s_per_iter"] / p["train_s_per_iter"],
        "wall_s_per_iter": s["wall_s_per_iter"] / p["wall_s_per_iter"],
    }
    print("SAPO / PPO ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"results": results, "sapo_over_ppo": ratios, "steps": args.steps,
               "model": {"hidden_size": args.hidden_size, "layers": args.layers},
               "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                           **git_provenance()}}
    # the default size keeps the historical name; another size gets its own file (sapo_vs_ppo_h256_l4.json)
    default = (args.hidden_size, args.layers) == (128, 4)
    path = RESULTS / ("sapo_vs_ppo.json" if default else f"sapo_vs_ppo_h{args.hidden_size}_l{args.layers}.json")
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
