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
    missing = sorted(files - set(rs.RESULT_SOURCES))
    assert not missing, f"add these to RESULT_SOURCES in benchmarks/result_sources.py: {missing}"
    for name, paths in rs.RESULT_SOURCES.items():
        for path in paths:
            assert (REPO / path).exists(), f"RESULT_SOURCES[{name!r}] names {path!r}, which does not exist"


@pytest.mark.skipif(not _git_history_available(), reason="needs a git checkout with history (not an sdist)")
def test_results_are_current_or_listed_stale():
    rs = _load()
    stale = rs.report()
    listed = rs.listed_stale()
    unlisted = {name: commits for name, commits in stale.items() if name not in listed}
    assert not unlisted, ("rerun these benchmarks, or list them under '## Stale results' in benchmarks/README.md: "
                          + "; ".join(f"{n} ({len(c)} later commits touch its code, e.g. {c[0]})"
                                      for n, c in unlisted.items()))
    unknown = sorted(listed - set(rs.RESULT_SOURCES))
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
    monkeypatch.setattr(rs, "RESULT_SOURCES", {"r.json": ["code.py"], "r.png": ["code.py"], "lone.png": ["code.py"]})

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
