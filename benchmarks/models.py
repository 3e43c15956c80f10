"""`--model` for the benchmarks: a checkpoint directory, a Qwen3 size name (dense or MoE), or
the demo model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tp_engine.demo import demo_checkpoint_dir
from tp_engine.testing import build_random_qwen3_moe, cached_random_qwen3

# Real Qwen3 dense shapes (from the released config.json files), for benchmarks.
QWEN3_PRESETS: dict[str, dict[str, Any]] = {
    "0.6B": dict(hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                 intermediate_size=3072, tie_word_embeddings=True),
    "1.7B": dict(hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8,
                 intermediate_size=6144, tie_word_embeddings=True),
    "4B": dict(hidden_size=2560, num_layers=36, num_heads=32, num_kv_heads=8,
               intermediate_size=9728, tie_word_embeddings=True),
    "8B": dict(hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
               intermediate_size=12288, tie_word_embeddings=False),
    "14B": dict(hidden_size=5120, num_layers=40, num_heads=40, num_kv_heads=8,
                intermediate_size=17408, tie_word_embeddings=False),
    "32B": dict(hidden_size=5120, num_layers=64, num_heads=64, num_kv_heads=8,
                intermediate_size=25600, tie_word_embeddings=False),
}  # fmt: skip
for _preset in QWEN3_PRESETS.values():
    _preset.update(
        head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1_000_000.0
    )

# Real Qwen3-MoE shapes (Qwen3-30B-A3B and Qwen3-235B-A22B config.json): every layer sparse
# (decoder_sparse_step 1, no mlp_only_layers), 128 experts, 8 routed per token, renormalised.
# `intermediate_size` (the configs' 6144 and 12288, for dense layers, of which there are none)
# is the builder's default, 8 * moe_intermediate_size.
QWEN3_MOE_PRESETS: dict[str, dict[str, Any]] = {
    "30B-A3B": dict(hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                    moe_intermediate_size=768),
    "235B-A22B": dict(hidden_size=4096, num_layers=94, num_heads=64, num_kv_heads=4,
                      moe_intermediate_size=1536),
}  # fmt: skip
for _preset in QWEN3_MOE_PRESETS.values():
    _preset.update(
        head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1_000_000.0,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=(), tie_word_embeddings=False,
    )  # fmt: skip

# Bump when the benchmark checkpoints' contents change, so old caches are not reused.
# v2: Qwen3's own tokenizer (151,669 tokens under the 151,936 rows), not the 640-token test one
# under which 99.6% of sampled ids had no text and streams arrived as one chunk.
_BENCH_CKPT_VERSION = 2


def preset_name(model: str) -> str | None:
    """'0.6B', 'qwen3-0.6b', 'Qwen/Qwen3-0.6B' or 'Qwen/Qwen3-30B-A3B' -> the preset's name;
    None for anything else."""
    key = model.rsplit("/", 1)[-1].upper().removeprefix("QWEN3-")
    names = [*QWEN3_PRESETS, *QWEN3_MOE_PRESETS]
    return next((name for name in names if name.upper() == key), None)


def resolve_model(model: str | None) -> Path:
    """The checkpoint directory to run. A size name builds (once, cached, atomically so that
    every torchrun rank may ask at once) a random-weight bf16 checkpoint of that real shape,
    with Qwen3's tokenizer (needs the `dashscope` package, see `build_qwen3_tokenizer`), in
    `$TP_ENGINE_CACHE/bench-qwen3-<size>-v<N>` (MoE sizes: `bench-qwen3-moe-<size>-v<N>`)."""
    if model is None:
        return demo_checkpoint_dir()
    name = preset_name(model)
    if name is None or Path(model).is_dir():
        path = Path(model)
        if not (path / "config.json").exists():
            raise ValueError(
                f"--model {model!r} is neither a checkpoint directory nor one of "
                f"{[*QWEN3_PRESETS, *QWEN3_MOE_PRESETS]}"
            )
        return path
    if name in QWEN3_MOE_PRESETS:
        return cached_random_qwen3(
            f"bench-qwen3-moe-{name}-v{_BENCH_CKPT_VERSION}",
            builder=build_random_qwen3_moe,
            **QWEN3_MOE_PRESETS[name],
            dtype="bfloat16",
            tokenizer="qwen3",
            max_shard_bytes=4 << 30,
        )
    return cached_random_qwen3(
        f"bench-qwen3-{name}-v{_BENCH_CKPT_VERSION}",
        **QWEN3_PRESETS[name],
        dtype="bfloat16",
        tokenizer="qwen3",
        max_shard_bytes=4 << 30,
    )


def read_hf_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())
