"""The built-in demo model: a tiny random-weight Qwen3 served when no `--model` is given, built
on first use and cached (see `tp_engine.testing.checkpoints.cached_random_qwen3`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tp_engine.testing.checkpoints import cached_random_qwen3

# Bump when the demo's shape or weights change, so old caches are not reused.
DEMO_VERSION = 1
DEMO_SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=192,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
    seed=0,
)


def demo_checkpoint_dir() -> Path:
    """The tiny random demo checkpoint, built on first use and cached in
    `$TP_ENGINE_CACHE/demo-qwen3-v<N>` (see `cached_random_qwen3`)."""
    return cached_random_qwen3(f"demo-qwen3-v{DEMO_VERSION}", **DEMO_SHAPE)
