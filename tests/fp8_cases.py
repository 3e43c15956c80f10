"""Shared by the FP8 tests: tiny FP8 checkpoints in Qwen's format and the near-tie judge.

An FP8 engine cannot match transformers token for token: its activations are quantized per
token and 128-group at run time (the published format's "dynamic" scheme), which transformers on
the dequantized weights does not do, and that legitimately flips a greedy choice where the top
two logits are close. So the judge follows the engine's own tokens through transformers
(teacher forcing) and, at every position where transformers' argmax differs from the engine's
token, measures the gap in transformers' logprobs between the two: a near-tie is a small gap;
a wrong kernel, a misplaced scale or a mis-sliced shard gives gaps of whole nats. Reported: the
fraction of tokens before the first divergence, and the gap at each divergence.

Widths are multiples of 128 (the FP8 block) and head_dim is 128 as in every Qwen3, so that TP
2 and 4 cut whole blocks; the MoE experts' 256 features split into whole blocks at TP 2 only
(TP 4 is refused, expert parallelism places whole experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MAX_MODEL_LEN = 64
MAX_TOKENS = 8
# Largest logprob gap at a divergence accepted as a near-tie. Measured when this was written:
# gaps of 0.16 and 0.17 (dense) and 0.09 (MoE) at the legitimate divergences, the same at every
# TP size and placement; the planted error of test_fp8_e2e (two layers' block scales x4) gives
# gaps up to 10 nats, most above 1, and diverges on its first token.
NEAR_TIE_NATS = 0.25
# The same with the fp8 KV cache on top of fp8 weights (a second quantization, of K and V at
# e4m3's 3 mantissa bits): 0.35 measured at the worst divergence (MoE, Triton path), where an
# expert choice flipped. Still a fraction of the planted error's gaps (most above 1 nat).
NEAR_TIE_NATS_FP8_KV = 0.5

DENSE = dict(
    hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128,
    intermediate_size=512, tie_word_embeddings=False, seed=31,
)  # fmt: skip
MOE = dict(
    hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True,
    tie_word_embeddings=False, seed=32,
)  # fmt: skip


@dataclass(frozen=True)
class Fp8Checkpoints:
    bf16: Path  # the random bf16 source
    fp8: Path  # quantized from it, Qwen's format
    dequantized: Path  # the fp8 weights dequantized to fp32: the reference's weights


def build_fp8_checkpoints(root: Path, moe: bool, **overrides: Any) -> Fp8Checkpoints:
    """`overrides`: fields of DENSE or MOE to change (e.g. `num_layers`)."""
    from tp_engine.testing import (
        build_random_qwen3,
        build_random_qwen3_moe,
        dequantize_checkpoint_fp8,
        quantize_checkpoint_fp8,
    )

    build, shape = (build_random_qwen3_moe, MOE) if moe else (build_random_qwen3, DENSE)
    shape = {**shape, **overrides}
    src = build(root / "bf16", max_position_embeddings=MAX_MODEL_LEN, dtype="bfloat16", **shape)
    fp8 = quantize_checkpoint_fp8(src, root / "fp8")
    return Fp8Checkpoints(src, fp8, dequantize_checkpoint_fp8(fp8, root / "dequantized"))


def load_hf(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def make_prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in (1, 6, 13, 29)]


@dataclass(frozen=True)
class Agreement:
    """How the engine's greedy tokens agree with the reference's."""

    lengths: list[int]  # per prompt: tokens the engine generated
    first_divergence: list[int | None]  # per prompt: index of the first disagreement, or None
    gaps: list[float]  # reference logprob(its argmax) - logprob(engine's token), per divergence

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def fraction_before_first_divergence(self) -> float:
        """Tokens generated before each prompt's first divergence, over all tokens generated."""
        before = (
            n if d is None else d for n, d in zip(self.lengths, self.first_divergence, strict=True)
        )
        return sum(before) / self.num_tokens

    @property
    def max_gap(self) -> float:
        return max(self.gaps, default=0.0)

    def report(self, what: str) -> str:
        gaps = ", ".join(f"{g:.4f}" for g in self.gaps) or "none"
        return (
            f"{what}: {self.fraction_before_first_divergence:.3f} of {self.num_tokens} tokens "
            f"before the first divergence; logprob gaps at divergences: {gaps}"
        )


def judge(model: Any, prompts: list[list[int]], engine_tokens: list[list[int]]) -> Agreement:
    """Teacher-force the engine's tokens through `model` (transformers) and measure every
    position where its argmax differs (see the module docstring)."""
    first: list[int | None] = []
    gaps: list[float] = []
    with torch.no_grad():
        for prompt, tokens in zip(prompts, engine_tokens, strict=True):
            ids = torch.tensor([prompt + tokens])
            logprobs = model(ids).logits[0].float().log_softmax(-1)  # [L, vocab]
            first_here = None
            for i, token in enumerate(tokens):
                row = logprobs[len(prompt) - 1 + i]
                best = int(row.argmax())
                if best != token:
                    gaps.append(float(row[best] - row[token]))
                    first_here = i if first_here is None else first_here
            first.append(first_here)
    return Agreement([len(t) for t in engine_tokens], first, gaps)
