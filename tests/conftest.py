"""Shared pytest set-up: our `kernels` package first on the path, hardware markers skipped."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# Hugging Face ships a library that is also called `kernels`; putting the repo root first makes
# every `import kernels` in the tests resolve to this project's package.
if str(REPO_ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(REPO_ROOT))


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
