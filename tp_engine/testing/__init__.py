"""The test kit: random-weight Qwen3 and Qwen3-MoE checkpoints in the Hugging Face layout,
their tokenizers, and checkpoints rewritten from others (FP8, fewer layers, scaled RoPE).

Tests and benchmarks build every model they run from here, since nothing downloads at run time.
The runtime itself uses it for one thing, the built-in demo model (`tp_engine.demo`, which
imports `checkpoints` from here; this package imports nothing back).

| module | what it writes |
| --- | --- |
| `tokenizers` | a small BPE trained here, and Qwen3's own from Qwen's published ranks |
| `checkpoints` | random dense and MoE checkpoints, and a cache of built ones |
| `rewrites` | FP8 quantized and dequantized copies, layer-dropped drafts, RoPE-scaled copies |
"""

from tp_engine.testing.checkpoints import (
    ROUTER_SCALE,
    build_random_qwen3,
    build_random_qwen3_moe,
    cache_dir,
    cached_random_qwen3,
)
from tp_engine.testing.rewrites import (
    FP8_QUANTIZATION_CONFIG,
    dequantize_checkpoint_fp8,
    quantize_checkpoint_fp8,
    rewrite_checkpoint,
    truncate_layers,
    with_rope_scaling,
)
from tp_engine.testing.tokenizers import (
    CHAT_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    QWEN3_ADDED_TOKENS,
    QWEN3_TOKENIZER_SIZE,
    QWEN3_VOCAB_ROWS,
    build_qwen3_tokenizer,
    build_tokenizer,
    qwen_tiktoken_path,
)

__all__ = [
    "CHAT_TEMPLATE",
    "ENDOFTEXT",
    "FP8_QUANTIZATION_CONFIG",
    "IM_END",
    "IM_START",
    "QWEN3_ADDED_TOKENS",
    "QWEN3_TOKENIZER_SIZE",
    "QWEN3_VOCAB_ROWS",
    "ROUTER_SCALE",
    "build_qwen3_tokenizer",
    "build_random_qwen3",
    "build_random_qwen3_moe",
    "build_tokenizer",
    "cache_dir",
    "cached_random_qwen3",
    "dequantize_checkpoint_fp8",
    "quantize_checkpoint_fp8",
    "qwen_tiktoken_path",
    "rewrite_checkpoint",
    "truncate_layers",
    "with_rope_scaling",
]
