"""Project-level facts the rest of the suite relies on."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_kernels_is_this_projects_package_not_hugging_faces():
    # Hugging Face publishes an unrelated library also called `kernels`; if it were installed
    # and shadowed ours, kernel tests would silently test the wrong code.
    import kernels

    assert Path(kernels.__file__).resolve().parent == REPO_ROOT / "kernels"


def test_hugging_faces_kernels_library_is_not_installed():
    # Where it is, transformers imports it at once (`transformers.activations`) and gets ours
    # inside the repository, and a process started elsewhere gets theirs for ours: every
    # model test fails with an ImportError that does not say why. transformers >= 5.25
    # requires it, hence the cap in pyproject.toml.
    from importlib import metadata

    try:
        dist = metadata.distribution("kernels")
    except metadata.PackageNotFoundError:
        return
    from packaging.requirements import Requirement

    def needs_it(requirement: str) -> bool:  # `kernels`, not only with an extra
        r = Requirement(requirement)
        return r.name == "kernels" and "extra" not in str(r.marker or "")

    required_by = sorted(
        d.metadata["Name"] for d in metadata.distributions() if any(map(needs_it, d.requires or ()))
    )
    raise AssertionError(
        f"Hugging Face's `kernels` {dist.version} is installed (required by {required_by}); "
        "it shares this project's `kernels` import name: uninstall it, and keep transformers "
        "below 5.25 (README, 'A note on the `kernels` package name')"
    )


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


def _sibling_edges(graph: dict[str, set[str]], packages: set[str]) -> dict[str, set[str]]:
    """The module graph seen package by package: at every level of the tree, the children of a
    package (each module beside its sub-packages on its own, each sub-package with everything
    inside it) and which of them import which. An import counts at the level where the two
    modules' paths part, as an edge between the children they are in. A package that holds
    nothing but sub-packages (`tp_engine.features`) is a folder, not a unit: its sub-packages
    count as their parent's children. A package's `__init__` importing its own contents (the
    re-exports of `tp_engine/__init__.py`) is not counted: it is what a package is for, and the
    module graph (`test_no_import_cycles`) already refuses a re-exported module that imports
    its package's `__init__` back."""
    children: dict[str, set[str]] = {}
    for module in graph:
        if "." in module:
            children.setdefault(module.rsplit(".", 1)[0], set()).add(module)

    def is_folder(name: str) -> bool:
        return name in packages and children.get(name, set()) <= packages

    def child(module: str, depth: int) -> str:
        """The child holding `module` of its ancestor with `depth` parts (0: the tree's root)."""
        parts = module.split(".")
        name = ".".join(parts[: depth + 1])
        while is_folder(name) and name != module:
            depth += 1
            name = ".".join(parts[: depth + 1])
        return name

    edges: dict[str, set[str]] = {}
    for module, deps in graph.items():
        for dep in deps:
            if module in packages and dep.startswith(module + "."):
                continue
            a, b = module.split("."), dep.split(".")
            depth = 0
            while depth < min(len(a), len(b)) and a[depth] == b[depth]:
                depth += 1
            x, y = child(module, depth), child(dep, depth)
            if x != y:
                edges.setdefault(x, set()).add(y)
    return edges


def test_no_import_cycles_between_packages():
    """Package by package, imports run one way: a feature package imports the core, the core
    never imports it back (it plugs in through `CoreHooks`); the same for every pair of packages
    in the tree, and for a package's own modules beside its sub-packages: `tp_engine/engine.py`
    imports the core, which imports `tp_engine/sampling_params.py`, and neither is imported back
    (`_sibling_edges`)."""
    graph = _project_imports()
    packages = {m for m in graph if (REPO_ROOT / m.replace(".", "/")).is_dir()}
    edges = _sibling_edges(graph, packages)
    assert "tp_engine.core" in edges["tp_engine.features.lora"]
    assert "tp_engine.sampling_params" in edges["tp_engine.core"]
    assert "tp_engine.core" in edges["tp_engine.engine"]
    # The shared leaf (`tp_engine/common/`) imports no other part of tp_engine.
    assert "tp_engine.common" in edges["tp_engine.core"]
    assert {d for d in edges.get("tp_engine.common", ()) if d.startswith("tp_engine")} == set()
    cycle = _first_cycle(edges)
    assert cycle is None, "packages import each other: " + " -> ".join(cycle or [])


def test_sibling_edges_see_a_module_and_the_package_beside_it():
    """The cycle the old rule (a package and its sub-packages one family) missed:
    `tp_engine/outputs.py` imported `tp_engine.core.sequence`, and `tp_engine.core.engine_core`
    imported `tp_engine.outputs`. No two modules import each other, but the module and the core
    package beside it do."""
    packages = {"tp_engine", "tp_engine.core", "tp_engine.core.kv", "tp_engine.features"}
    packages |= {"tp_engine.features.lora", "tp_engine.features.structured"}
    graph = {
        "tp_engine": {"tp_engine.outputs", "tp_engine.sampling_params"},
        "tp_engine.outputs": {"tp_engine.core", "tp_engine.core.sequence"},
        "tp_engine.sampling_params": set(),
        "tp_engine.engine": {"tp_engine.core", "tp_engine.core.engine_core"},
        "tp_engine.core": set(),
        "tp_engine.core.sequence": {"tp_engine.sampling_params"},
        "tp_engine.core.engine_core": {
            "tp_engine.outputs",
            "tp_engine.core.kv",
            "tp_engine.features.structured.grammar",
        },
        "tp_engine.core.kv": set(),
        "tp_engine.core.kv.block_manager": {"tp_engine.core.sequence"},
        "tp_engine.features": set(),
        "tp_engine.features.lora": set(),
        "tp_engine.features.lora.control": {"tp_engine.core", "tp_engine.core.sequence"},
        "tp_engine.features.structured": set(),
        "tp_engine.features.structured.grammar": set(),
    }
    assert _first_cycle(graph) is None
    edges = _sibling_edges(graph, packages)
    # Between tp_engine's children: the core as a whole, each top-level module on its own; the
    # package's __init__ re-exporting `outputs` is not counted.
    assert edges["tp_engine.core"] == {
        "tp_engine.outputs",
        "tp_engine.sampling_params",
        "tp_engine.features.structured",
    }
    assert edges["tp_engine.outputs"] == {"tp_engine.core"}
    assert edges["tp_engine.engine"] == {"tp_engine.core"}
    assert "tp_engine" not in edges
    # `tp_engine.features` is a folder: its packages stand beside the core one by one, so the
    # core importing structured outputs' grammar while LoRA imports the core is no cycle.
    assert edges["tp_engine.features.lora"] == {"tp_engine.core"}
    assert "tp_engine.features" not in edges
    # Inside the core, the KV package and the core's own modules are the children.
    assert edges["tp_engine.core.engine_core"] == {"tp_engine.core.kv"}
    assert edges["tp_engine.core.kv"] == {"tp_engine.core.sequence"}
    assert _first_cycle(edges) == ["tp_engine.core", "tp_engine.outputs", "tp_engine.core"]
    # The step outputs moved into the core, as they are now: no cycle.
    graph["tp_engine.core.outputs"] = {"tp_engine.core.sequence"}
    del graph["tp_engine.outputs"]
    graph["tp_engine"] = {"tp_engine.core.outputs", "tp_engine.sampling_params"}
    graph["tp_engine.core.engine_core"].discard("tp_engine.outputs")
    graph["tp_engine.core.engine_core"].add("tp_engine.core.outputs")
    assert _first_cycle(_sibling_edges(graph, packages)) is None


def test_no_runtime_module_is_large():
    """Small modules about one thing: none in tp_engine/ or rank_worker/ past 500 lines."""
    sizes = {
        str(path.relative_to(REPO_ROOT)): len(path.read_text().splitlines())
        for package in ("tp_engine", "rank_worker")
        for path in (REPO_ROOT / package).rglob("*.py")
    }
    assert len(sizes) > 100
    assert {name: n for name, n in sizes.items() if n > 500} == {}


def test_few_modules_beside_the_packages():
    """A package's own modules are few, the rest in its sub-packages (what a newcomer reads
    first is the list of rooms, not a corridor of files): at most 10 beside `tp_engine/`'s
    packages, `__init__` not counted."""
    top = sorted(p.stem for p in (REPO_ROOT / "tp_engine").glob("*.py") if p.stem != "__init__")
    assert "engine" in top and "sampling_params" in top
    assert len(top) <= 10, top
