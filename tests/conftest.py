"""Shared pytest set-up: our `kernels` package first on the path, Triton's interpreter on machines
without a GPU, hardware markers skipped, slow files scheduled first."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# Hugging Face ships a library that is also called `kernels`; putting the repo root first makes
# every `import kernels` in the tests resolve to this project's package.
if str(REPO_ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(REPO_ROOT))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return torch.cuda.is_available()


# Without a GPU the Triton kernels run under Triton's interpreter (numpy, on CPU tensors). Triton
# reads TRITON_INTERPRET when each `@triton.jit` decorator runs, i.e. when `kernels` is first
# imported, so this must happen here, before any test module is collected. With a GPU it stays
# unset and the same tests run natively. `setdefault`: an explicit setting wins.
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _num_cuda_devices() -> int:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    num_gpus = _num_cuda_devices()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multigpu = pytest.mark.skip(reason=f"needs two or more CUDA GPUs, found {num_gpus}")
    for item in items:
        if "gpu" in item.keywords and num_gpus < 1:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and num_gpus < 2:
            item.add_marker(skip_multigpu)
    _slow_files_first(items)


def _slow_files_first(items: list[pytest.Item]) -> None:
    """Every file holding a `slow` test before the others; each file's tests stay together, in
    their order (a stable sort on the file alone).

    pytest-xdist (`--dist loadfile` in pyproject's addopts) hands whole files to its workers in
    this order as they run low: the multi-process files, up to minutes each, go out first and
    the many quick ones fill in behind them, so the workers finish at about the same time
    rather than one running a long file alone at the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
