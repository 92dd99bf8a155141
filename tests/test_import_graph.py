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
    assert "async_rl.rollout.servers.hf" in graph["async_rl.rollout.replicas"]  # the graph sees real edges
    assert cycles(graph) == []


# Packages (and top-level modules) from the bottom up, in the direction data flows: env -> rollout -> buffer ->
# batch -> advantages -> update -> weights back to the rollout. A package may import only packages of lower
# layers; the top layer (entry points, assembly, reporting) may also import its own members. `models` sits above
# `envs` because the SFT warm start (models/sft.py) trains on the envs' demonstrations; `engine` below `models`
# because the log-prob kernels run inside the engine's precision root.
LAYERS: list[set[str]] = [
    {"validation"},  # config rules (plain Python)
    {"config"},  # the algorithm's hyperparameters and the plan table (plain Python: the CLI checks before torch)
    {"algos"},  # pure tensor equations (spec)
    {"sandbox"},
    {"rewards"},
    {"data"},
    {"envs"},
    {"engine"},
    {"models"},
    {"rollout"},
    {"verl_plugin"},  # registers algos' functions (and, lazily, the hf rollout replica) in verl's registries
    {"workers"},
    {"driver"},
    {"tracking", "run_summary", "plots", "eval", "train", "cli_config", "run_dir", "run_log", "assemble", "progress",
     "settings"},
]


def package_of(module: str) -> str:
    """``async_rl.driver.batch`` -> ``driver``; ``async_rl.train`` -> ``train``; ``async_rl`` -> ``async_rl``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layering_violations(graph: dict[str, set[str]], layers: list[set[str]]) -> list[str]:
    layer_of = {pkg: i for i, members in enumerate(layers) for pkg in members}
    top = len(layers) - 1
    bad = []
    for module, targets in sorted(graph.items()):
        src = package_of(module)
        for target in sorted(targets):
            dst = package_of(target)
            if src == dst or src == "async_rl" or dst == "async_rl":
                continue  # within a package the module-level cycle test applies; the root __init__ only registers
            if src not in layer_of or dst not in layer_of:
                bad.append(f"{module} -> {target}: package {src if src not in layer_of else dst!r} has no layer")
            elif layer_of[dst] > layer_of[src] or (layer_of[dst] == layer_of[src] and layer_of[src] != top):
                bad.append(f"{module} -> {target}: {src} imports {dst}, a package above it")
    return bad


def test_the_layering_checker_finds_a_back_arrow():
    graph = {"async_rl.engine.settings": {"async_rl.models.loading"}, "async_rl.models.logprobs": {"async_rl.engine.x"}}
    assert layering_violations(graph, [{"engine"}, {"models"}]) == [
        "async_rl.engine.settings -> async_rl.models.loading: engine imports models, a package above it"]
    assert layering_violations({"async_rl.a.x": {"async_rl.b.y"}}, [{"a", "b"}, {"c"}]) != []  # peers below the top
    assert layering_violations({"async_rl.a.x": {"async_rl.b.y"}}, [{"c"}, {"a", "b"}]) == []  # peers at the top


def test_packages_import_only_packages_below_them():
    """The package-level rule that a module-level cycle test cannot see (issue 35): engine <-> models and
    workers -> driver were package cycles without any module cycle."""
    graph = import_graph()
    packages = {package_of(m) for m in graph} - {"async_rl"}
    assert packages == set().union(*LAYERS), "every package and top-level module has a layer"
    assert layering_violations(graph, LAYERS) == []


def test_the_driver_imports_no_model_worker_or_engine_code():
    """The driver holds the buffer, versions and publishing; assembling a run (models, roles, Ray groups,
    replicas) is ``assemble.py``'s job, and the roles reach the driver typed by Protocols (driver/roles.py)."""
    graph = import_graph()
    reached = {(module, target) for module, targets in graph.items() if package_of(module) == "driver"
               for target in targets if package_of(target) in ("workers", "models", "engine")}
    assert reached == set()


def test_every_trainer_role_meets_the_learners_protocols():
    from async_rl.driver.roles import ROLE_ATTRIBUTES, PolicyRole, SharedBackboneRole, ValueRole
    from async_rl.workers.remote import RemoteActor, RemoteCritic, RemoteSapo
    from async_rl.workers.roles import ActorRole, CriticRole
    from async_rl.workers.sapo import SapoRole

    for cls in (ActorRole, RemoteActor):
        assert issubclass(cls, PolicyRole), cls
    for cls in (CriticRole, RemoteCritic):
        assert issubclass(cls, ValueRole), cls
    for cls in (SapoRole, RemoteSapo):
        assert issubclass(cls, SharedBackboneRole), cls
    assert not issubclass(CriticRole, PolicyRole)  # the check is not vacuous
    for cls in (ActorRole, RemoteActor, CriticRole, RemoteCritic, SapoRole, RemoteSapo):
        assert all(hasattr(cls, name) for name in ROLE_ATTRIBUTES), cls
