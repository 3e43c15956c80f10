"""Triton kernels and their plain-torch references (`<op>` beside `<op>_ref`).

Not to be confused with Hugging Face's `kernels` library, which has the same import name; the
test suite checks that `import kernels` resolves to this package.

| module | kernel | reference | in place? |
|---|---|---|---|
| `store_kv` | `store_kv` | `store_kv_ref` | yes: writes the caches |
| `prefill_attention` | `paged_prefill_attention` | `paged_prefill_attention_ref` | no |
| `decode_attention` | `paged_decode_attention` (stage 1: the split kernel or `decode_attention_packed`'s, by `attention_tables`) | `paged_decode_attention_ref` | no |
| `prefill_attention_tma` | `fresh_prefill_attention` (fresh prompts from their dense K/V through TMA descriptors; chosen by `attention_tables`) | `paged_prefill_attention_ref` | no |
| `rmsnorm` | `rms_norm`, `fused_add_rms_norm` | `rms_norm_ref`, `fused_add_rms_norm_ref` | no |
| `rotary` | `rotary_embedding` | `rotary_embedding_ref` | kernel yes, reference no |
| `qk_norm_rope` | `qk_norm_rope` (Qwen3's q/k RMSNorm + rotary) | `qk_norm_rope_ref` | kernel yes, reference no |
| `activation` | `silu_and_mul` | `silu_and_mul_ref` | no |
| `fused_moe` | `fused_moe` (experts: grouped GEMMs, SiLU·mul fused; `moe_align`) | `fused_moe_ref` | no |

Every wrapper checks its arguments before it launches, once per layout of them (shapes,
strides, dtypes, devices: `_common.LaunchMemo`), so the layers of an eager step after the first
only allocate and launch; the attention wrappers also split into a checked plan
(`plan_decode_attention`, `plan_prefill_attention`) that a caller keeps for a step and a launch.

The kernels run on CUDA tensors, or on CPU tensors under the Triton interpreter when
`TRITON_INTERPRET=1` is set before this package is imported (Triton fixes the mode when each
`@triton.jit` decorator runs). This package imports nothing from the rest of the project.
"""

from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.decode_attention import (
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from kernels.fused_moe import fused_moe, fused_moe_ref, moe_align
from kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_ref
from kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from kernels.rotary import rotary_embedding, rotary_embedding_ref
from kernels.store_kv import store_kv, store_kv_ref

__all__ = [
    "choose_num_splits",
    "fused_add_rms_norm",
    "fused_add_rms_norm_ref",
    "fused_moe",
    "fused_moe_ref",
    "moe_align",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "qk_norm_rope",
    "qk_norm_rope_ref",
    "rms_norm",
    "rms_norm_ref",
    "rotary_embedding",
    "rotary_embedding_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
    "store_kv",
    "store_kv_ref",
]
