"""Every saved benchmark result is current with the code it measures, or benchmarks/README.md says it is stale
(issue 22: numbers in the docs must trace to results of today's code)."""

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("result_sources", REPO / "benchmarks" / "result_sources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _git_history_available() -> bool:
    if shutil.which("git") is None:
        return False
    out = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=REPO, capture_output=True, text=True)
    return out.returncode == 0 and out.stdout.strip() == "true"


def test_every_result_file_names_the_code_it_measures():
    rs = _load()
    files = {p.name for p in (REPO / "benchmarks" / "results").iterdir() if p.is_file()}
    missing = sorted(files - set(rs.RESULT_INPUTS))
    assert not missing, f"add these to RESULT_INPUTS in benchmarks/result_sources.py: {missing}"
    for name, paths in rs.RESULT_INPUTS.items():
        for path in paths:
            assert (REPO / path).exists(), f"RESULT_INPUTS[{name!r}] names {path!r}, which does not exist"


def test_results_are_current_or_listed_stale():
    # no skip: outside a full git checkout the provenance cannot be checked, and passing would hide stale numbers
    assert _git_history_available(), "the provenance check needs a git checkout with its history (git clone)"
    rs = _load()
    stale = rs.report()
    listed = rs.listed_stale()
    unlisted = {name: commits for name, commits in stale.items() if name not in listed}
    assert not unlisted, ("rerun these benchmarks, or list them under '## Stale results' in benchmarks/README.md: "
                          + "; ".join(f"{n} ({len(c)} later commits touch its code, e.g. {c[0]})"
                                      for n, c in unlisted.items()))
    unknown = sorted(listed - set(rs.RESULT_INPUTS))
    assert not unknown, f"benchmarks/README.md lists stale results that do not exist: {unknown}"


def test_new_json_results_record_commit_and_dirty_flag():
    """Results written since the provenance change carry git_commit and git_dirty (machine info)."""
    path = REPO / "benchmarks" / "results" / "advantage_kernels.json"
    machine = json.loads(path.read_text())["machine"]
    assert isinstance(machine["git_commit"], str) and len(machine["git_commit"]) >= 7
    assert isinstance(machine["git_dirty"], bool)


def test_stale_section_parser(tmp_path):
    rs = _load()
    readme = tmp_path / "README.md"
    readme.write_text("# B\n\n## Stale results\n\n- `a.json`: reason `x.py`\n- `b.png`, `e.json`: why\n"
                      "- `f.json` no colon\nnot a list `c.json`:\n\n## Next\n- `d.json`: stale elsewhere\n")
    assert rs.listed_stale(readme) == {"a.json", "b.png", "e.json"}


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_figure_redrawn_with_the_same_pixels_counts_from_its_json(tmp_path, monkeypatch):
    rs = _load()
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    monkeypatch.setattr(rs, "REPO", tmp_path)
    monkeypatch.setattr(rs, "RESULTS", results)
    monkeypatch.setattr(rs, "RESULT_INPUTS", {"r.json": ["code.py"], "r.png": ["code.py"], "lone.png": ["code.py"]})

    def commit(message):
        subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message],
                       cwd=tmp_path, check=True)

    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "code.py").write_text("v = 1\n")
    (results / "r.json").write_text('{"v": 1}\n')
    (results / "r.png").write_bytes(b"pixels")
    (results / "lone.png").write_bytes(b"pixels")
    commit("first run")
    (tmp_path / "code.py").write_text("v = 2\n")
    commit("code change")
    assert set(rs.report()) == {"r.json", "r.png", "lone.png"}
    (results / "r.json").write_text('{"v": 2}\n')  # the rerun: same figure bytes, new JSON
    commit("rerun")
    assert set(rs.report()) == {"lone.png"}  # a figure without a JSON of its stem still needs its own rewrite


def test_a_result_committed_after_later_code_counts_from_the_commit_it_records(tmp_path, monkeypatch):
    """A result measured on old code (its JSON records that commit) and committed after a code change is stale, not
    current because the file itself is newer."""
    rs = _load()
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    monkeypatch.setattr(rs, "REPO", tmp_path)
    monkeypatch.setattr(rs, "RESULTS", results)
    monkeypatch.setattr(rs, "RESULT_INPUTS", {"late.json": ["code.py"], "fresh.json": ["code.py"]})

    def commit(message):
        subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message],
                       cwd=tmp_path, check=True)
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, check=True, capture_output=True,
                              text=True).stdout.strip()

    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "code.py").write_text("v = 1\n")
    old = commit("code v1")
    (tmp_path / "code.py").write_text("v = 2\n")
    new = commit("code v2")
    (results / "late.json").write_text(json.dumps({"machine": {"git_commit": old, "git_dirty": False}}))
    (results / "fresh.json").write_text(json.dumps({"machine": {"git_commit": new, "git_dirty": False}}))
    commit("results")
    assert rs.report() == {"late.json": [new]}
    (results / "late.json").write_text(json.dumps({"machine": {"git_commit": "f" * 40}}))  # unknown: the file's date
    commit("a hash from elsewhere")
    assert rs.report() == {}


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_import_closure_follows_every_kind_of_import(tmp_path):
    """Module-level, in-function, relative and ``from pkg import module`` imports, package ``__init__`` files,
    benchmark-local modules and module names in string literals (``-m async_rl.x``) all count; a docstring that
    mentions a module and third-party imports do not."""
    rs = _load()
    _write(tmp_path, {
        "benchmarks/_helper.py": "import async_rl.alpha\n",
        "benchmarks/bench.py": ('"""Runs python -m async_rl.unused_doc."""\nimport json\nimport _helper\n'
                                'def f():\n    from async_rl.pkg import beta\n'
                                'CMD = ["python", "-m", "async_rl.cli"]\nENV = "async_rl.pkg.gamma:Env"\n'),
        "src/async_rl/__init__.py": "",
        "src/async_rl/alpha.py": "",
        "src/async_rl/cli.py": "",
        "src/async_rl/unused_doc.py": "",
        "src/async_rl/pkg/__init__.py": "",
        "src/async_rl/pkg/beta.py": "from . import delta\nfrom ..alpha import x\n",
        "src/async_rl/pkg/delta.py": "",
        "src/async_rl/pkg/gamma.py": "",
        "src/async_rl/pkg/never.py": "",
    })
    rs._direct_imports.cache_clear()
    got = rs.import_closure(["benchmarks/bench.py"], tmp_path)
    assert got == {"benchmarks/bench.py", "benchmarks/_helper.py", "src/async_rl/__init__.py",
                   "src/async_rl/alpha.py", "src/async_rl/cli.py", "src/async_rl/pkg/__init__.py",
                   "src/async_rl/pkg/beta.py", "src/async_rl/pkg/delta.py", "src/async_rl/pkg/gamma.py"}
    rs._direct_imports.cache_clear()


def test_training_results_depend_on_the_workers_they_run():
    """The hand-written map of issue 22 left workers/ out: an edit to workers/roles.py left the training results
    current. The derived sources include it for every training benchmark, and a kernel micro-benchmark does not
    depend on the driver."""
    rs = _load()
    for name in ("async_vs_sync.json", "algorithms_toy.json", "sapo_vs_ppo.json", "stability_map.json",
                 "demo_summary.json"):
        assert "src/async_rl/workers/roles.py" in rs.sources(name), name
    assert "src/async_rl/driver/core.py" not in rs.sources("advantage_kernels.json")
    assert "src/async_rl/algos/gae.py" in rs.sources("advantage_kernels.json")


def test_a_shallow_clone_fails_loudly(tmp_path, monkeypatch):
    """On a ``--depth 1`` clone every result's last commit is the boundary, so everything would look current:
    the check must refuse instead of passing."""
    rs = _load()
    origin = tmp_path / "origin"
    origin.mkdir()
    run = lambda *a, cwd=origin: subprocess.run(["git", *a], cwd=cwd, check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    for i in range(2):
        (origin / "f.txt").write_text(str(i))
        run("add", "-A")
        run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", f"c{i}")
    clone = tmp_path / "clone"
    run("clone", "-q", "--depth", "1", f"file://{origin}", str(clone), cwd=tmp_path)
    monkeypatch.setattr(rs, "REPO", clone)
    with pytest.raises(rs.ShallowHistory, match="unshallow"):
        rs.report()
    monkeypatch.setattr(rs, "REPO", origin)
    rs.require_full_history()  # the full history passes


def test_docs_quoting_a_result_from_a_dirty_tree_say_so():
    """A result written from uncommitted code (``git_dirty: true``) describes code no commit holds: every doc
    that names its file must say "dirty" in the same paragraph."""
    docs = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for path in sorted((REPO / "benchmarks" / "results").glob("*.json")):
        machine = json.loads(path.read_text()).get("machine", {})
        if machine.get("git_dirty") is not True:
            continue
        for doc in docs:
            for paragraph in doc.read_text().split("\n\n"):
                if path.name in paragraph:
                    assert "dirty" in paragraph, (f"{doc.relative_to(REPO)} quotes {path.name}, which was written "
                                                  "from a dirty tree, without saying so")
