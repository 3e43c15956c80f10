"""What the user asks of the engine, and how they ask it.

| module | holds |
| --- | --- |
| `engine` | `EngineConfig`: one frozen dataclass with vLLM's argument names, checked on creation |
| `flags` | the engine's command-line flags, one table that `launch/serve.py`, `launch/generate.py` and `launch/bench.py` all read, each flag an `EngineConfig` field |
| `help_format` | the `--help` formatter of those scripts (every default shown) |
| `generation` | what a checkpoint's generation_config.json contributes (EOS ids, sampling defaults) |

Only `engine` is imported here: the engine core reads its config without the flags' imports.
"""

from tp_engine.config.engine import (
    ATTENTION_BACKENDS,
    CONVERTS,
    DTYPES,
    KV_CACHE_DTYPES,
    RUNNERS,
    EngineConfig,
    parse_hf_overrides,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "CONVERTS",
    "DTYPES",
    "KV_CACHE_DTYPES",
    "RUNNERS",
    "EngineConfig",
    "parse_hf_overrides",
]
