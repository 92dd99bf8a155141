"""Which code each file in ``results/`` measures, and which results are older than that code.

A result is *current* when no commit after the last one that touched the result file touches any of its
code paths (``git log <that commit>..HEAD -- <paths>`` is empty; a figure dates from its JSON's commit when
that is newer, :func:`written_with`); otherwise it is stale, and ``benchmarks/README.md`` must list it under "Stale results" (a line ``- `<file>`, `<file>`: why``).
``tests/test_benchmark_provenance.py`` checks both, and that every result file has an entry here.
A result file not committed yet counts as current (it is being regenerated).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"

# code every training benchmark runs: the local actor/critic, the schedulers, the hf engine, toy_keys and its
# registered facts and warm-start demonstrations
_TRAINING = ["benchmarks/_common.py", "src/async_rl/algos", "src/async_rl/driver", "src/async_rl/models",
             "src/async_rl/engine", "src/async_rl/config.py", "src/async_rl/envs/toy.py",
             "src/async_rl/envs/base.py", "src/async_rl/envs/facts.py", "src/async_rl/envs/demonstrations.py",
             "src/async_rl/rollout/base.py", "src/async_rl/rollout/hf_engine.py"]
# what a command-line run adds: config validation, the metrics sinks, the rollout client the trainer calls
_CLI = ["src/async_rl/validation.py", "src/async_rl/tracking.py", "src/async_rl/rollout/client.py"]
_ROLLOUT = ["src/async_rl/rollout", "src/async_rl/driver", "src/async_rl/workers", "src/async_rl/train.py"]

RESULT_SOURCES: dict[str, list[str]] = {
    "aime_tiny_gate.json": ["benchmarks/aime_tiny_gate.py", "recipes/aime_tiny.yaml", "recipes/data", "conf",
                            "src/async_rl/train.py", "src/async_rl/envs/math_env.py", "src/async_rl/rewards",
                            "src/async_rl/models/sft.py", "src/async_rl/workers", "src/async_rl/run_summary.py",
                            *_CLI, *_TRAINING],
    "advantage_kernels.json": ["benchmarks/advantage_kernels.py", "src/async_rl/algos/gae.py"],
    "algorithms_toy.json": ["benchmarks/algorithms_toy.py", *_TRAINING],
    "algorithms_toy.png": ["benchmarks/algorithms_toy.py", *_TRAINING],
    "async_vs_sync.json": ["benchmarks/async_vs_sync.py", *_TRAINING],
    "async_vs_sync.png": ["benchmarks/async_vs_sync.py", *_TRAINING],
    "critic_offline.json": ["benchmarks/critic_offline.py", *_TRAINING],
    "framework_overhead.json": ["benchmarks/framework_overhead.py", *_TRAINING],
    "framework_overhead_quick.json": ["benchmarks/framework_overhead.py", *_TRAINING],
    "group_vs_single.json": ["benchmarks/group_vs_single.py", "benchmarks/lag_probe.py", *_TRAINING],
    "group_vs_single.png": ["benchmarks/group_vs_single.py", "benchmarks/lag_probe.py", *_TRAINING],
    "group_vs_single_longtail.json": ["benchmarks/group_vs_single.py", "benchmarks/lag_probe.py", *_TRAINING],
    "group_vs_single_lr0.001.json": ["benchmarks/group_vs_single.py", "benchmarks/lag_probe.py", *_TRAINING],
    "group_vs_single_lr0.001.png": ["benchmarks/group_vs_single.py", "benchmarks/lag_probe.py", *_TRAINING],
    "longtail_barrier_model.json": ["benchmarks/longtail_barrier_model.py",
                                    "benchmarks/results/group_vs_single_longtail.json", "benchmarks/_common.py",
                                    "src/async_rl/driver/episode.py"],
    "memory_model.json": ["benchmarks/memory_model.py", "src/async_rl/engine", "src/async_rl/models"],
    "peak_memory.json": ["benchmarks/peak_memory.py", "benchmarks/memory_model.py", "src/async_rl/engine",
                         "src/async_rl/models"],
    "rollout_replicas.json": ["benchmarks/rollout_replicas.py", *_ROLLOUT],
    "replica_profile.json": ["benchmarks/replica_profile.py", "benchmarks/rollout_replicas.py", *_ROLLOUT],
    "rollout_throughput.json": ["benchmarks/rollout_throughput.py", "src/async_rl/rollout/base.py",
                                "src/async_rl/rollout/hf_engine.py"],
    "sapo_vs_ppo.json": ["benchmarks/sapo_vs_ppo.py", *_TRAINING],
    "sapo_vs_ppo_h256_l4.json": ["benchmarks/sapo_vs_ppo.py", *_TRAINING],
    "demo_rollout_hybrid.txt": ["benchmarks/demo_rollout_logs.py", "conf", *_CLI, *_ROLLOUT, *_TRAINING],
    "demo_rollout_replicas.txt": ["benchmarks/demo_rollout_logs.py", "conf", *_CLI, *_ROLLOUT, *_TRAINING],
    "install_vllm_dry_run.txt": ["Makefile", "pyproject.toml"],
    "call_costs.json": ["benchmarks/call_costs.py", "src/async_rl/envs/base.py", "src/async_rl/sandbox",
                        "src/async_rl/rewards/math_reward.py"],
    "warm_start.json": ["benchmarks/warm_start.py", "src/async_rl/models/sft.py", "src/async_rl/models/tiny.py",
                        "src/async_rl/envs/toy.py", "src/async_rl/envs/facts.py",
                        "src/async_rl/envs/demonstrations.py"],
    "demo_summary.json": ["benchmarks/demo_summary.py", "conf", "src/async_rl/train.py", "src/async_rl/run_summary.py",
                          *_CLI, *_TRAINING],
    "demo_rollout_vllm.txt": ["benchmarks/demo_rollout_logs.py", "conf", *_CLI, *_ROLLOUT, *_TRAINING],
    "smollm2_cpu.json": ["benchmarks/smollm2_cpu.py", "benchmarks/_common.py", "src/async_rl/models",
                         "src/async_rl/rollout/base.py", "src/async_rl/rollout/hf_engine.py"],
    "rollout_engines.json": ["benchmarks/rollout_engines.py", "src/async_rl/rollout", "src/async_rl/models"],
    "sandbox_hardening.json": ["benchmarks/sandbox_hardening.py", "src/async_rl/sandbox"],
    "stability_map.json": ["benchmarks/stability_map.py", "src/async_rl/run_summary.py", *_TRAINING],
    "stability_map.png": ["benchmarks/stability_map.py", "src/async_rl/run_summary.py", *_TRAINING],
    "stability_ablation.json": ["benchmarks/stability_map.py", "src/async_rl/run_summary.py", *_TRAINING],
    "lisao_demo_seeds.json": ["benchmarks/lisao_demo_seeds.py", "benchmarks/stability_map.py", "conf",
                              "src/async_rl/train.py", "src/async_rl/run_summary.py", *_CLI, *_TRAINING],
    "kl_guard_replay.json": ["benchmarks/kl_guard_replay.py", "benchmarks/stability_map.py", "benchmarks/_common.py",
                             "benchmarks/results/stability_map.json", "src/async_rl/driver/kl_guard.py",
                             "src/async_rl/run_summary.py"],
}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()


def written_with(name: str) -> list[str]:
    """The result files one run writes together with ``name``: a figure and the JSON of the same stem. A rerun
    that draws the same pixels leaves the figure's bytes, hence its git history, as they were; the JSON beside it
    (which records the commit) dates both."""
    stem = name.rsplit(".", 1)[0]
    if name.endswith(".png") and f"{stem}.json" in RESULT_SOURCES:
        return [name, f"{stem}.json"]
    return [name]


def commits_since_result(name: str) -> list[str]:
    """Short hashes of the commits after the result's last commit that touch its code (newest first);
    empty for a current result or one not committed yet. A figure counts from the newer of its own last commit
    and its JSON's (:func:`written_with`)."""
    last = _git("log", "-1", "--format=%H", "--", *(f"benchmarks/results/{n}" for n in written_with(name)))
    if not last:
        return []
    out = _git("log", "--format=%h", f"{last}..HEAD", "--", *RESULT_SOURCES[name])
    return out.split()


def listed_stale(readme: Path = Path(__file__).resolve().parent / "README.md") -> set[str]:
    """Result files named in the README's "Stale results" section: the backticked names before the colon of
    each ``- `<file>`, `<file>`: reason`` line."""
    text = readme.read_text()
    match = re.search(r"^## Stale results\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    if not match:
        return set()
    names: set[str] = set()
    for head in re.findall(r"^- (`[^:\n]*):", match.group(1), flags=re.M):  # the files named before the colon
        names.update(re.findall(r"`([^`]+)`", head))
    return names


def report() -> dict[str, list[str]]:
    """``{result file: commits since it}`` for every stale result."""
    return {name: c for name in sorted(RESULT_SOURCES) if (RESULTS / name).exists()
            and (c := commits_since_result(name))}


if __name__ == "__main__":
    for name, commits in report().items():
        print(f"{name}: {len(commits)} later commits touch its code ({', '.join(commits[:5])} ...)")
