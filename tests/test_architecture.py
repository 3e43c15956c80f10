"""`docs/architecture.md` tells the truth: its table names the tree's packages, one short line
each, and the import claims of its opening paragraph hold (read from the source, as
`tests/test_project.py` reads it)."""

from __future__ import annotations

import ast
import re

from tests.test_project import REPO_ROOT, _project_imports

PAGE = REPO_ROOT / "docs" / "architecture.md"
RUNTIME = ("tp_engine", "rank_worker", "shm_ipc", "kernels")


def _table_rows() -> dict[str, str]:
    """Package path (as the table spells it, without the trailing slash) -> its one line."""
    rows = {}
    for line in PAGE.read_text().splitlines():
        if m := re.match(r"^\| `([\w/]+)/`(?: \(top level\))? \| (.*) \|$", line):
            rows[m.group(1)] = m.group(2)
    return rows


def _packages(root: str) -> set[str]:
    return {
        str(p.parent.relative_to(REPO_ROOT))
        for p in (REPO_ROOT / root).glob("*/__init__.py")
        if "__pycache__" not in p.parts
    }


def test_the_table_names_every_package_and_only_real_ones():
    rows = _table_rows()
    assert "tp_engine/core" in rows and "rank_worker/dist" in rows
    for name in rows:
        assert (REPO_ROOT / name).is_dir(), f"the table names {name}/, which does not exist"
    # Every package directly under these has a row of its own (deeper ones are in their
    # parent's line).
    for root in (*RUNTIME, "tp_engine/core", "tp_engine/server"):
        missing = {p for p in _packages(root) if p not in rows}
        assert missing == set(), f"packages missing from docs/architecture.md: {sorted(missing)}"
    for top in (*RUNTIME, "launch", "benchmarks", "tests"):
        assert top in rows


def test_one_short_line_per_package():
    long = {name: len(line) for name, line in _table_rows().items() if len(line) > 200}
    assert long == {}


def _top_level_imports(package: str) -> set[str]:
    """Top-level names every module under `package` imports (any import statement)."""
    names: set[str] = set()
    for path in (REPO_ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


ALLOWED = {
    "tp_engine": {"rank_worker", "shm_ipc", "kernels"},
    "rank_worker": {"shm_ipc", "kernels"},
    "shm_ipc": set(),
    "kernels": set(),
}
CORE_FORBIDDEN = ("rank_worker", "tp_engine.frontend", "tp_engine.server", "tp_engine.engine")
CORE_FEATURES = {
    "tp_engine.features",
    "tp_engine.features.structured",
    "tp_engine.features.structured.grammar",
}


def _direction_faults(imports: dict[str, set[str]]) -> dict[str, list[str]]:
    """Runtime package -> the project's top-level packages it imports against the page."""
    faults = {}
    for package, names in imports.items():
        bad = (names & {*RUNTIME, "launch", "benchmarks", "tests"}) - {package} - ALLOWED[package]
        if bad:
            faults[package] = sorted(bad)
    return faults


def _core_faults(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Core module -> what it imports that the page says the core does not."""
    faults = {}
    for module, deps in graph.items():
        if not module.startswith("tp_engine.core"):
            continue
        bad = [d for d in deps if d.startswith(CORE_FORBIDDEN)]
        bad += [d for d in deps if d.startswith("tp_engine.features") and d not in CORE_FEATURES]
        if bad:
            faults[module] = sorted(bad)
    return faults


def test_imports_run_the_way_the_page_says():
    imports = {package: _top_level_imports(package) for package in RUNTIME}
    assert "rank_worker" in imports["tp_engine"]
    assert _direction_faults(imports) == {}


def test_the_core_imports_what_the_page_says():
    graph = _project_imports()
    assert "tp_engine.core.scheduler" in graph
    assert _core_faults(graph) == {}


def test_the_checks_catch_a_planted_import():
    imports = {package: set() for package in RUNTIME}
    imports["rank_worker"] = {"tp_engine", "torch"}
    imports["kernels"] = {"benchmarks"}
    assert _direction_faults(imports) == {"rank_worker": ["tp_engine"], "kernels": ["benchmarks"]}
    graph = {
        "tp_engine.core.pipeline": {"tp_engine.features.lora.registry", "tp_engine.core.sequence"},
        "tp_engine.core.sequence": {"tp_engine.features.structured.grammar"},
        "tp_engine.core.intake": {"rank_worker.models.model_spec"},
    }
    assert _core_faults(graph) == {
        "tp_engine.core.pipeline": ["tp_engine.features.lora.registry"],
        "tp_engine.core.intake": ["rank_worker.models.model_spec"],
    }
