"""The commands of docs/offline.md: `launch/generate.py` as plain Python and under torchrun, demo model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--json", "--max-tokens", "6", "--prompt", "Hello, my name is", "--prompt", "Once upon"]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    # A private cache: the demo checkpoint is built on first use, as on a fresh machine.
    return dict(os.environ, TP_ENGINE_CACHE=str(tmp_path_factory.mktemp("cache")))


def run(cmd: list[str], env: dict[str, str]) -> list[dict]:
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_generate_plain_python_and_torchrun_agree(env):
    single = run([sys.executable, "launch/generate.py", *ARGS], env)
    assert [r["prompt"] for r in single] == ["Hello, my name is", "Once upon"]
    for r in single:
        assert r["finish_reason"] in ("length", "stop") and 1 <= len(r["token_ids"]) <= 6

    spawned = run([sys.executable, "launch/generate.py", "--tensor-parallel-size", "2", *ARGS], env)
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    under_torchrun = run([*torchrun, "launch/generate.py", *ARGS], env)
    # Greedy and float32: the tensor-parallel runs give the same tokens as one rank.
    assert [r["token_ids"] for r in spawned] == [r["token_ids"] for r in single]
    assert [r["token_ids"] for r in under_torchrun] == [r["token_ids"] for r in single]
