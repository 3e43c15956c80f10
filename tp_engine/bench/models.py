"""`--model` for the benchmarks: a checkpoint directory, a Qwen3 size name, or the demo model."""

from __future__ import annotations

import json
from pathlib import Path

from tp_engine.checkpoints import QWEN3_PRESETS, cached_random_qwen3, demo_checkpoint_dir

# Bump when the benchmark checkpoints' contents change, so old caches are not reused.
_BENCH_CKPT_VERSION = 1


def preset_name(model: str) -> str | None:
    """'0.6B', 'qwen3-0.6b' or 'Qwen/Qwen3-0.6B' -> '0.6B'; None for anything else."""
    key = model.rsplit("/", 1)[-1].upper().removeprefix("QWEN3-")
    return next((name for name in QWEN3_PRESETS if name.upper() == key), None)


def resolve_model(model: str | None) -> Path:
    """The checkpoint directory to run. A size name builds (once, cached, atomically so that
    every torchrun rank may ask at once) a random-weight bf16 checkpoint of that real shape in
    `$TP_ENGINE_CACHE/bench-qwen3-<size>-v<N>`."""
    if model is None:
        return demo_checkpoint_dir()
    name = preset_name(model)
    if name is None or Path(model).is_dir():
        path = Path(model)
        if not (path / "config.json").exists():
            raise ValueError(
                f"--model {model!r} is neither a checkpoint directory nor one of {list(QWEN3_PRESETS)}"
            )
        return path
    return cached_random_qwen3(
        f"bench-qwen3-{name}-v{_BENCH_CKPT_VERSION}",
        **QWEN3_PRESETS[name],
        dtype="bfloat16",
        max_shard_bytes=4 << 30,
    )


def read_hf_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())
