"""The multi-LoRA shrink and expand kernels, per token and grouped by slot, against their torch
references, and the references (and the CPU path, `lora_apply_by_slot`) against a per-token
dense LoRA (`y[t] += B[s] A[s] x[t]`, nothing shared with them).

Cases: a decode-sized step (T = 1), a mixed prefill (T = 37) over every slot and the base, a
step of base tokens only (nothing added), packed parts of unequal widths (q 48 rows, k and v 16
each, as a QKV shard) and one part (o/down), ranks 8 and 16, fp32 and bf16.
Tolerances: fp32 sums in another order, ~1e-6; bf16 inputs with fp32 accumulation, the output
rounded once to bf16 (one ulp, 2^-7 relative, of values up to ~30).
"""

from __future__ import annotations

import pytest
import torch

from kernels.lora import (
    lora_apply_by_slot,
    lora_expand,
    lora_expand_ref,
    lora_shrink,
    lora_shrink_ref,
)
from kernels.lora_grouped import lora_expand_grouped, lora_shrink_grouped, lora_token_groups

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.bfloat16: dict(atol=0.25, rtol=2e-2)}
# (num tokens, input features, part widths, slots S, rank R, slot pattern)
CASES = [
    (1, 32, [48, 16, 16], 3, 16, "mixed"),
    (37, 96, [48, 16, 16], 4, 8, "mixed"),
    (37, 64, [40], 2, 16, "mixed"),
    (9, 32, [24, 24], 2, 8, "base"),
]
# Natively on a GPU: Qwen3-8B's QKV shard at TP = 1 and its down_proj input, rank 16 over
# 16 slots, and the largest rank.
GPU_CASES = [
    (256, 4096, [4096, 1024, 1024], 16, 16, "mixed"),
    (33, 12288, [4096], 4, 64, "mixed"),
    (8, 1024, [2048, 512, 512], 2, 512, "mixed"),
]
ALL_CASES = [*CASES, *(pytest.param(c, marks=pytest.mark.gpu) for c in GPU_CASES)]


def _case_id(c: tuple) -> str:
    return f"T{c[0]}-K{c[1]}-P{len(c[2])}-r{c[4]}-{c[5]}"


def _inputs(t, k, widths, num_slots, rank, pattern, dtype):
    gen = torch.Generator().manual_seed(t * 131 + k)
    parts = len(widths)
    x = torch.randn(t, k, generator=gen)
    a = torch.randn(num_slots, parts, rank, k, generator=gen) / k**0.5
    b = torch.randn(num_slots, sum(widths), rank, generator=gen)
    y = torch.randn(t, sum(widths), generator=gen)
    if pattern == "base":
        slots = torch.full((t,), -1, dtype=torch.int32)
    else:  # every slot and the base, interleaved
        slots = (torch.arange(t, dtype=torch.int32) * 7 % (num_slots + 1)) - 1
    offsets = torch.tensor([0, *torch.tensor(widths).cumsum(0).tolist()], dtype=torch.int32)

    def on(tensor, dt=dtype):
        return tensor.to(device=DEVICE, dtype=dt if tensor.is_floating_point() else tensor.dtype)

    return on(x), on(a), on(b), on(y), on(slots), on(offsets), max(widths)


def _dense(x, a, b, y, slots, offsets):
    """Per token: y[t] + B[s] (A[s] x[t]), part by part, in fp64."""
    out = y.double().clone()
    bounds = offsets.tolist()
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        for p in range(a.shape[1]):
            rows = slice(bounds[p], bounds[p + 1])
            out[t, rows] += b[s, rows].double() @ (a[s, p].double() @ x[t].double())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ALL_CASES, ids=_case_id)
def test_shrink_expand_match_reference(case: tuple, dtype: torch.dtype) -> None:
    x, a, b, y, slots, offsets, widest = _inputs(*case, dtype)
    expected = _dense(x, a, b, y, slots, offsets)
    ref_y = y.clone()
    lora_expand_ref(ref_y, lora_shrink_ref(x, a, slots), b, slots, offsets.tolist())
    torch.testing.assert_close(ref_y.double(), expected.to(dtype).double(), **TOL[dtype])
    by_slot = y.clone()  # the CPU path
    lora_apply_by_slot(by_slot, x, a, b, slots, offsets.tolist())
    torch.testing.assert_close(by_slot.float(), ref_y.float(), **TOL[dtype])
    out = y.clone()
    lora_expand(out, lora_shrink(x, a, slots), b, slots, offsets, widest)
    torch.testing.assert_close(out.float(), ref_y.float(), **TOL[dtype])
    groups = lora_token_groups(slots, a.shape[0])
    grouped = y.clone()
    h = lora_shrink_grouped(x, a, groups)
    lora_expand_grouped(grouped, h, b, groups, offsets, widest)
    torch.testing.assert_close(grouped.float(), ref_y.float(), **TOL[dtype])
    if case[5] == "base":
        assert torch.equal(out, y) and torch.equal(grouped, y)  # nothing added, not a rounding
