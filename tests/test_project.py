"""Project-level facts the rest of the suite relies on."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_kernels_is_this_projects_package_not_hugging_faces():
    # Hugging Face publishes an unrelated library also called `kernels`; if it were installed
    # and shadowed ours, kernel tests would silently test the wrong code.
    import kernels

    assert Path(kernels.__file__).resolve().parent == REPO_ROOT / "kernels"


def test_control_plane_imports_no_cuda_or_process_groups():
    import subprocess
    import sys

    code = (
        "import sys; import tp_engine.core.scheduler, tp_engine.core.plan_builder;"
        "bad = [m for m in sys.modules if m.startswith(('torch', 'triton', 'rank_worker'))];"
        "print(','.join(bad))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""


def _project_imports() -> dict[str, set[str]]:
    """Module -> the project's modules it imports, read from the source: every import
    statement, at module level, under `if TYPE_CHECKING:` or inside a function."""
    import ast

    modules = {}
    for package in ("tp_engine", "rank_worker", "shm_ipc", "kernels", "launch"):
        for path in (REPO_ROOT / package).rglob("*.py"):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    if submodule in modules:
                        deps.add(submodule)  # `from pkg import module`
                    elif node.module in modules:
                        deps.add(node.module)
        # Importing `a.b.c` runs package `a.b`'s __init__ first: an edge to every package on the
        # way, except the importer's own (whose __init__ is already under way).
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        for dep in list(deps):
            parts = dep.split(".")
            for i in range(1, len(parts)):
                package = ".".join(parts[:i])
                if package in modules and package not in own:
                    deps.add(package)
        deps.discard(name)
        graph[name] = deps
    return graph


def _first_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the directed graph `edges` (node -> nodes it points to) as a path that ends
    where it starts, visiting nodes in sorted order; None when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_no_import_cycles():
    # Type-only and deferred imports count too: a cycle among them still means two modules
    # that cannot be understood (or split) one without the other.
    graph = _project_imports()
    assert "tp_engine.core.sequence" in graph and "tp_engine.core.running_batch" in graph
    cycle = _first_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycles_between_packages():
    """Package by package, imports run one way: a feature package imports the core, the core
    never imports it back (it plugs in through `CoreHooks`); the same for every pair of packages
    in the tree. A module counts for the package that holds it; a package and the packages
    inside it are one family, whose mutual imports are not counted."""
    graph = _project_imports()

    def package(module: str) -> str:
        if (REPO_ROOT / module.replace(".", "/")).is_dir():
            return module
        return module.rsplit(".", 1)[0] if "." in module else module

    edges: dict[str, set[str]] = {}
    for module, deps in graph.items():
        a = package(module)
        for dep in deps:
            b = package(dep)
            if a != b and not b.startswith(a + ".") and not a.startswith(b + "."):
                edges.setdefault(a, set()).add(b)
    assert "tp_engine.core" in edges["tp_engine.features.lora"]
    cycle = _first_cycle(edges)
    assert cycle is None, "packages import each other: " + " -> ".join(cycle or [])


def test_no_runtime_module_is_large():
    """Small modules about one thing: none in tp_engine/ or rank_worker/ past 600 lines."""
    sizes = {
        str(path.relative_to(REPO_ROOT)): len(path.read_text().splitlines())
        for package in ("tp_engine", "rank_worker")
        for path in (REPO_ROOT / package).rglob("*.py")
    }
    assert len(sizes) > 100
    assert {name: n for name, n in sizes.items() if n > 600} == {}
