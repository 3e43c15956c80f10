"""Decisions made once and reused: the kernel wrappers' checks once per argument layout
(`kernels._common.LaunchMemo`), the triton backend's attention once per step and geometry
(`rank_worker.attention.triton_plan`).

What reuse must never do: launch a layout with another's grid or constexprs, or let an argument
through that a first call would have refused. So each test first makes a decision, then calls
with what differs from it in one way (the token count, the strides, the head count, the
cache's dtype) and compares with the reference, or expects the refusal.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first `import kernels` (tests/conftest too)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from rank_worker.attention import triton_plan
from rank_worker.attention.selection import get_backend
from tests.test_attention_backends import CASES, KERNEL_DEVICE, make_case, run_backend

DEVICE = KERNEL_DEVICE
EXACT = dict(atol=1e-5, rtol=1e-5)  # fp32, kernel against reference (summation order only)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE)


def test_rms_norm_decides_per_token_count_and_layout():
    w = _randn(16, seed=1)
    for rows in (3, 40, 3, 1):  # a decided layout again, after others
        x = _randn(rows, 16, seed=rows)
        torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), **EXACT)
        res = _randn(rows, 16, seed=rows + 100)
        normed, summed = fused_add_rms_norm(x, res, w, 1e-6)
        ref_normed, ref_summed = fused_add_rms_norm_ref(x, res, w, 1e-6)
        torch.testing.assert_close(normed, ref_normed, **EXACT)
        torch.testing.assert_close(summed, ref_summed, **EXACT)
    # [T, heads, dim] after [T, dim] of the same row count: other row addressing.
    x3 = _randn(3, 4, 16, seed=7)
    torch.testing.assert_close(rms_norm(x3, w, 1e-6), rms_norm_ref(x3, w, 1e-6), **EXACT)


def test_a_checked_shape_does_not_let_other_strides_through():
    w = _randn(16)
    rms_norm(_randn(4, 16), w, 1e-6)  # [4, 16] contiguous: decided
    strided = _randn(16, 4).t()  # [4, 16] too, its last dim not dense
    with pytest.raises(ValueError, match="contiguous last dim"):
        rms_norm(strided, w, 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(_randn(4, 16), w.double(), 1e-6)
    silu_and_mul(_randn(4, 32))
    with pytest.raises(ValueError, match="contiguous last dim"):
        silu_and_mul(_randn(32, 4).t())


def test_silu_and_mul_decides_per_token_count():
    for rows in (2, 33, 2):
        x = _randn(rows, 64, seed=rows)
        torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **EXACT)


def _count_plans(monkeypatch) -> list[str]:
    made: list[str] = []
    real = triton_plan.StepAttention.plan

    def spy(*args, **kwargs):
        made.append("plan")
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_plan.StepAttention, "plan", staticmethod(spy))
    return made


@pytest.mark.parametrize("case_name", ["decode_only", "decodes_first", "mixed"])
def test_one_plan_per_step_serves_every_layer(monkeypatch, case_name):
    """Three layers on one metadata, each with caches and queries of its own: one plan, and
    each layer's output the torch backend's for that layer's tensors."""
    made = _count_plans(monkeypatch)
    triton, torch_backend = get_backend("triton"), get_backend("torch")
    meta = make_case(CASES[case_name], 4, 2, 16, 4, torch.float32, DEVICE).meta
    for layer in range(3):
        case = make_case(CASES[case_name], 4, 2, 16, 4, torch.float32, DEVICE, seed=layer)
        case.meta = meta  # the step's one metadata; the layer's own caches and queries
        out, k_cache, v_cache = run_backend(triton, case)
        ref, k_ref, v_ref = run_backend(torch_backend, case)
        torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0)
        torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)
        torch.testing.assert_close(out, ref, **EXACT)
    assert made == ["plan"]


@pytest.mark.parametrize("case_name", ["decode_only", "decodes_first"])
def test_another_geometry_on_the_same_step_gets_its_own_plan(monkeypatch, case_name):
    """A layer with more query heads (or another cache dtype) on a step already planned: a
    reused plan would launch the first geometry's grid and head count, wrong rows."""
    made = _count_plans(monkeypatch)
    triton, torch_backend = get_backend("triton"), get_backend("torch")
    first = make_case(CASES[case_name], 4, 2, 16, 4, torch.float32, DEVICE)
    run_backend(triton, first)
    for heads, dtype in (((8, 2), torch.float32), ((4, 2), torch.bfloat16)):
        case = make_case(CASES[case_name], *heads, 16, 4, dtype, DEVICE, seed=3)
        case.meta = first.meta
        out, _, _ = run_backend(triton, case)
        ref, _, _ = run_backend(torch_backend, case)
        tol = EXACT if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(out, ref, **tol)
    assert made == ["plan", "plan", "plan"]
