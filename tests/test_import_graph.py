"""Data flows one way through the stages, and so do imports: no two modules of async_rl import each other,
directly or through others, counting imports inside functions (issue 20)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the async_rl modules it imports (``from a.b import c`` counts a.b.c when that is a module)."""
    modules = {_module_name(p): p for p in (SRC / "async_rl").rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                           for alias in node.names]
            for target in targets:
                if target in modules and target != name and not name.startswith(target + "."):
                    # a package's __init__ re-exporting its submodules is not a stage edge
                    if not (path.name == "__init__.py" and target.startswith(name + ".")):
                        graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_async_rl():
    graph = import_graph()
    assert "async_rl.rollout.replica" in graph["async_rl.rollout.replicas"]  # the graph sees real edges
    assert cycles(graph) == []
