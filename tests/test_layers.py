"""The import graph of ``daskpipe/`` follows the layers (docs/architecture.md), read with ``ast``.

Every import counts, at module level or inside a function: a function-level import is still an
arrow between modules, only a later one.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "daskpipe"

# The lower layers, and what they may never import.
LOWER = ("daskpipe.profiles", "daskpipe.plan", "daskpipe.sched")
UPPER = ("daskpipe.runtime", "daskpipe.sim", "daskpipe.dashboard", "daskpipe.benchmarks")
# Benchmarks and experiments live here, above the library; only the top-level front end imports them.
BENCHMARKS = "daskpipe.benchmarks"
FRONT_END = ("daskpipe", "daskpipe.cli")

# The layers, lowest first: a module imports from its own package or from lower layers only.
# Front ends (the CLIs, the top-level package) and benchmarks sit above them all.
UTILITIES, COLOCATION_CORE, PROFILES, PLAN, SCHED, DATA_PLANE, DASHBOARD, TOP = range(8)
PACKAGE_LAYERS = {
    "daskpipe.config": UTILITIES,
    "daskpipe.jsonfile": UTILITIES,
    "daskpipe.progress": UTILITIES,
    "daskpipe.mipmodels": UTILITIES,
    "daskpipe.colocation": COLOCATION_CORE,  # a leaf library, but for its bridges below
    "daskpipe.profiles": PROFILES,
    "daskpipe.plan": PLAN,
    "daskpipe.graft": PLAN,  # Graft's planner; its simulator is a data plane (below)
    "daskpipe.sched": SCHED,
    "daskpipe.sim": DATA_PLANE,
    "daskpipe.runtime": DATA_PLANE,
    "daskpipe.dashboard": DASHBOARD,
}
MODULE_LAYERS = {
    "daskpipe.colocation.profiles": PLAN,  # co-location's planning bridge: profiles in, a Plan out
    "daskpipe.colocation.planner": PLAN,
    "daskpipe.colocation.execute": SCHED,  # co-located latencies for the data planes
    "daskpipe.graft.simulate": DATA_PLANE,
}


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_bench(module: str) -> bool:
    return within(module, BENCHMARKS)


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@dataclass
class Graph:
    """Arrows between daskpipe modules, and the private names that cross them."""

    modules: set[str]
    edges: dict[str, set[str]] = field(default_factory=dict)
    private: set[tuple[str, str]] = field(default_factory=set)  # (importer, "module._name")


def resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def build_graph(package: Path = PACKAGE) -> Graph:
    paths = {module_name(path, package): path for path in package.rglob("*.py")}
    graph = Graph(set(paths))
    for importer, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets: set[str] = set()
        aliases: dict[str, str] = {}  # local name bound to a daskpipe module -> that module
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if within(alias.name, "daskpipe"):
                        targets.add(alias.name)
                        if alias.asname:
                            aliases[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom):
                source = resolve(importer, path.name == "__init__.py", node)
                if not within(source, "daskpipe"):
                    continue
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    if submodule in graph.modules:
                        targets.add(submodule)
                        aliases[alias.asname or alias.name] = submodule
                    else:
                        targets.add(source)
                        if is_private(alias.name):
                            graph.private.add((importer, f"{source}.{alias.name}"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases and is_private(node.attr):
                graph.private.add((importer, f"{aliases[node.value.id]}.{node.attr}"))
        graph.edges[importer] = {target for target in targets if target in graph.modules and target != importer}
    return graph


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def layer(module: str) -> int:
    if is_bench(module) or module in FRONT_END or module.endswith(".cli"):
        return TOP
    return MODULE_LAYERS.get(module, PACKAGE_LAYERS[package(module)])


def against_the_layers(graph: Graph) -> set[tuple[str, str]]:
    """Arrows to a higher layer, or between the simulator and the runtime (siblings)."""
    return {
        (importer, target)
        for importer, targets in graph.edges.items()
        for target in targets
        if layer(target) > layer(importer) or {package(importer), package(target)} == {"daskpipe.sim", "daskpipe.runtime"}
    }


def into_the_benchmarks(graph: Graph) -> set[tuple[str, str]]:
    """Arrows from the library (every module but the benchmarks and the top-level front end) into the benchmarks."""
    return {
        (importer, target)
        for importer, targets in graph.edges.items()
        if not is_bench(importer) and importer not in FRONT_END
        for target in targets
        if is_bench(target)
    }


def upward_arrows(graph: Graph) -> set[tuple[str, str]]:
    return {
        (importer, target)
        for importer, targets in graph.edges.items()
        if any(within(importer, lower) for lower in LOWER)
        for target in targets
        if any(within(target, upper) for upper in UPPER)
    }


@pytest.fixture(scope="module")
def graph() -> Graph:
    return build_graph()


def test_the_reader_sees_late_relative_and_private_imports(tmp_path: Path) -> None:
    package = tmp_path / "daskpipe"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "a.py").write_text("from . import b\n\ndef f():\n    return b._hidden\n")
    (package / "sub" / "b.py").write_text("def g():\n    from daskpipe.sub.c import _secret\n")
    (package / "sub" / "c.py").write_text("from daskpipe.sub import a\n")
    graph = build_graph(package)
    assert cycles(graph.edges) == [["daskpipe.sub.a", "daskpipe.sub.b", "daskpipe.sub.c"]]
    assert graph.private == {("daskpipe.sub.a", "daskpipe.sub.b._hidden"), ("daskpipe.sub.b", "daskpipe.sub.c._secret")}


def test_no_import_cycles(graph: Graph) -> None:
    assert cycles(graph.edges) == []


def test_no_private_name_crosses_a_module(graph: Graph) -> None:
    assert sorted(graph.private) == []


def test_lower_layers_import_nothing_above_them(graph: Graph) -> None:
    assert sorted(upward_arrows(graph)) == []


def test_no_library_package_imports_the_benchmarks(graph: Graph) -> None:
    assert sorted(into_the_benchmarks(graph)) == []


def test_benchmarks_live_in_their_package(graph: Graph) -> None:
    assert sorted(module for module in graph.modules if module.rsplit(".", 1)[-1] == "bench" and not is_bench(module)) == []


def test_imports_follow_the_layers(graph: Graph) -> None:
    assert sorted(against_the_layers(graph)) == []


def test_no_test_module_imports_another_test_module_or_a_conftest() -> None:
    """Shared test code lives in helper modules (``tests/**/helpers.py``); fixtures stay in conftest,
    which pytest loads itself and which nothing imports."""
    tests = Path(__file__).resolve().parent
    found = []
    for path in sorted(tests.rglob("*.py")):
        importer = module_name(path, tests)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = resolve(importer, path.name == "__init__.py", node)
                imported = [source] + [f"{source}.{alias.name}" for alias in node.names]
            else:
                continue
            leaves = {name.rsplit(".", 1)[-1] for name in imported if within(name, "tests")}
            found += [f"{importer} imports {leaf}" for leaf in sorted(leaves) if leaf.startswith("test_") or leaf == "conftest"]
    assert found == []


# The runtime by process (docs/architecture.md): which group may import which. ``deploying`` is
# shared by the client (at deploy) and the scheduler (at a re-plan); ``daskpipe.runtime.errors``
# and the modules at the runtime's top are every process's.
RUNTIME = "daskpipe.runtime"
PROCESS_GROUPS = ("client", "scheduler", "worker", "wire", "deploying")
PROCESS_BORDERS = {
    "worker": {"scheduler", "client"},  # a stage worker knows the scheduler only by its messages
    "scheduler": {"client", "worker"},  # the scheduler side never holds a tensor nor a model
    "wire": {"client", "scheduler", "worker", "deploying"},  # the vocabulary every process shares
}
NO_TORCH = ("scheduler", "wire")  # ``dask scheduler --preload daskpipe`` runs these


def process_group(module: str) -> str | None:
    parts = module.split(".")
    if not within(module, RUNTIME) or len(parts) < 4 or parts[2] not in PROCESS_GROUPS:
        return None
    return parts[2]


def across_the_process_borders(graph: Graph) -> set[tuple[str, str]]:
    return {
        (importer, target)
        for importer, targets in graph.edges.items()
        for target in targets
        if process_group(target) in PROCESS_BORDERS.get(process_group(importer) or "", set())
    }


def torch_imported_by(modules: list[str], root: Path) -> list[str]:
    """The torch modules that importing ``modules`` (in a fresh interpreter, from ``root``) loads."""
    import subprocess
    import sys

    code = f"import sys\nfor m in {modules!r}:\n    __import__(m)\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root).stdout
    return ast.literal_eval(shown.strip())


def test_the_process_reader_sees_a_worker_importing_the_scheduler(tmp_path: Path) -> None:
    package = tmp_path / "daskpipe"
    for folder in ("", "runtime", "runtime/worker", "runtime/scheduler"):
        (package / folder).mkdir(exist_ok=True)
        (package / folder / "__init__.py").write_text("")
    (package / "runtime" / "scheduler" / "plugin.py").write_text("import torch\n")
    (package / "runtime" / "worker" / "stage.py").write_text("def f():\n    from daskpipe.runtime.scheduler import plugin\n")
    assert across_the_process_borders(build_graph(package)) == {("daskpipe.runtime.worker.stage", "daskpipe.runtime.scheduler.plugin")}
    assert "torch" in torch_imported_by(["daskpipe.runtime.scheduler.plugin"], tmp_path)


def test_the_runtime_keeps_its_process_borders(graph: Graph) -> None:
    assert sorted(across_the_process_borders(graph)) == []


def test_the_scheduler_side_imports_no_torch(graph: Graph) -> None:
    """``dask scheduler --preload daskpipe`` runs the plugin and its request path, which carry control
    only: request inputs stay raw bytes or byte counts there (daskpipe/runtime/wire/inputs.py), never tensors."""
    scheduler_side = sorted(module for module in graph.modules if process_group(module) in NO_TORCH)
    assert len(scheduler_side) > 10
    assert torch_imported_by(["daskpipe", *scheduler_side], PACKAGE.parent) == []
