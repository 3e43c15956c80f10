"""Operations a decode step launches per decoder layer (`benchmarks.op_count`), counted on
CPU with the Triton kernels under the interpreter: the fused layer kernels bring the triton path
from about 60 to 10 (GPU-PREFLIGHT item 1; figures in benchmarks/results/cpu/hot-path), and
the K/V store fused into the q/k norm + rotary kernel to 9 (issue 48; figures in
benchmarks/results/cpu/one-sequence-fusion)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first `import kernels` (tests/conftest too)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.op_count import OpCounter, count_decode_step, small_model_dir

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_the_counter_counts_work_not_views_allocations_or_interpreter_staging():
    from kernels.activation import silu_and_mul

    x = torch.randn(4, 32, device=DEVICE)
    counter = OpCounter()
    with counter.counting():
        y = x.view(2, 64).t()  # views: nothing launched
        z = torch.empty(3, device=DEVICE)  # an allocation: nothing launched
        w = x.float()  # a cast with nothing to do: nothing launched
        silu_and_mul(x)  # one kernel (its output allocation and the interpreter's copies: none)
        x.to(torch.bfloat16)  # a real cast
        x + 1.0
    del y, z, w
    assert [name for _, name, work in counter.ops if work] == [
        "triton:_silu_and_mul_kernel",
        "_to_copy",
        "add",
    ]
    assert counter.count() == 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(small_model_dir(tmp_path_factory.mktemp("ops")))


def test_fused_decode_step_launches_nine_operations_per_layer(model_dir):
    fused = count_decode_step(model_dir, attention_backend="triton")
    assert fused["ops_per_layer"] == 9
    assert fused["layer_ops_by_name"] == {
        "linear": 4,  # qkv, o_proj, gate_up, down
        "triton:_rms_norm_kernel": 2,  # input and post-attention norms, residual add fused
        # q/k norm + rotary in place on the QKV output, and the K/V store (no store_kv launch)
        "triton:_qk_norm_rope_kernel": 1,
        "triton:_decode_split_kernel": 1,  # one split at this context length: no merge
        "triton:_silu_and_mul_kernel": 1,
    }
    assert fused["ops_each_layer"] == [9, 9]  # the first layer's norm has nothing to add
    # The same attention kernels with the layers in plain torch: what the fused kernels save.
    unfused = count_decode_step(model_dir, attention_backend="triton", layer_kernels="torch")
    assert unfused["ops_per_layer"] >= 50
