"""Which layer may import which: facts about the package layout the import graph alone does not
show (the cycle tests in test_project.py see only cycles)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _loaded_after(statement: str, prefixes: tuple[str, ...]) -> list[str]:
    """Modules starting with one of `prefixes` that a fresh interpreter holds after `statement`."""
    code = (
        f"import sys; {statement};"
        f"print(','.join(sorted(m for m in sys.modules if m.startswith({prefixes!r}))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    return [m for m in result.stdout.strip().split(",") if m]


def test_config_imports_no_rank_code_and_no_torch():
    # The configuration is read by every process, the API process and scripts' --help included;
    # the values it needs from the ranks' side are plain data in it (e.g. the LoRA flags' choices).
    statement = (
        "import argparse; from tp_engine.config import flags; parser = argparse.ArgumentParser();"
        "flags.add_engine_flags(parser); flags.engine_kwargs(parser.parse_args([]))"
    )
    loaded = _loaded_after(statement, ("rank_worker", "torch"))
    assert loaded == []
    # The check sees what it is meant to: importing a rank module is seen.
    assert "rank_worker.lora.peft_adapter" in _loaded_after(
        "import rank_worker.lora.peft_adapter", ("rank_worker",)
    )


def test_config_offers_the_lora_values_every_rank_accepts():
    from rank_worker import runner_config
    from tp_engine.config import engine

    assert engine.LORA_DTYPES == runner_config.LORA_DTYPES
    assert engine.MAX_LORA_RANKS == runner_config.MAX_LORA_RANKS


def test_rank_worker_is_rooms_with_few_modules_beside_them():
    # rank_worker/ is laid out in packages (dist, control, runner, spec, inputs, kv, models,
    # attention, lora); only the modules every room shares sit beside them.
    root = REPO_ROOT / "rank_worker"
    modules = sorted(p.name for p in root.glob("*.py") if p.name != "__init__.py")
    packages = sorted(p.name for p in root.iterdir() if (p / "__init__.py").exists())
    assert {"dist", "control", "runner", "spec", "inputs", "kv", "models"} <= set(packages)
    assert len(modules) <= 10, modules
