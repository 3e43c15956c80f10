"""No Triton kernel is compiled again once the engine has started.

Triton compiles one binary per specialisation of a kernel's arguments (an int's value being 1
or a multiple of 16, a pointer's 16-byte alignment, dtypes, constexprs). Anything that varies
from step to step and is specialised on compiles new binaries mid-serving: a latency spike
each time. On a GPU the JIT's cache shows that; under the interpreter nothing is compiled, so
`benchmarks.triton_launches.SpecializationLog` computes, with the JIT's own binder, the key
each launch would be compiled under, and the tests assert on the set of keys.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # must precede the first `import kernels` (tests/conftest too)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

from benchmarks.triton_launches import SpecializationLog

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _copy_rows(out_ptr, x_ptr, stride, N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, N)
    tl.store(out_ptr + row * N + cols, tl.load(x_ptr + row * stride + cols))


@triton.jit(do_not_specialize=["stride"], do_not_specialize_on_alignment=["x_ptr"])
def _copy_rows_unspecialised(out_ptr, x_ptr, stride, N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, N)
    tl.store(out_ptr + row * N + cols, tl.load(x_ptr + row * stride + cols))


def test_the_log_sees_what_the_jit_specialises_on():
    """The measuring tool itself: a varying stride (1, a multiple of 16, neither) and a pointer
    at an unaligned offset make new keys, unless the kernel opts out."""
    x = torch.arange(64 * 40, dtype=torch.float32, device=DEVICE)
    log = SpecializationLog()
    with log.watch():
        for kernel in (_copy_rows, _copy_rows_unspecialised):
            for stride, offset in ((16, 0), (20, 0), (1, 0), (16, 1), (16, 4)):
                out = torch.empty(2, 16, device=DEVICE)
                kernel[(2,)](out, x[offset:], stride, N=16)
                assert torch.equal(out[1], x[offset + stride : offset + stride + 16])
    assert len(log.keys["_copy_rows"]) == 4  # stride 16 / 20 / 1, and x at offset 1 (4 bytes)
    assert len(log.keys["_copy_rows_unspecialised"]) == 1
    assert log.launches == 10


def test_decode_and_prefill_kernels_have_one_binary_per_geometry():
    """Block tables of every width, split counts, and the slices a mixed batch passes."""
    from kernels.decode_attention import paged_decode_attention
    from kernels.prefill_attention import paged_prefill_attention

    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(40, 4, 2, 16, generator=gen).to(DEVICE)
    v_cache = torch.randn(40, 4, 2, 16, generator=gen).to(DEVICE)
    log = SpecializationLog()
    with log.watch():
        for width in (1, 3, 17):
            # Short contexts (the width is what matters: it is the table's row stride).
            seq_lens = torch.full((4,), min(4 * width, 6), dtype=torch.int32, device=DEVICE)
            table = torch.randint(0, 40, (4, width), generator=gen, dtype=torch.int32).to(DEVICE)
            for num_splits in (1, 3):
                for first in (0, 1, 2):  # slices at 4-byte offsets, as a mixed batch has
                    q = torch.randn(4 - first, 4, 16, generator=gen).to(DEVICE)
                    paged_decode_attention(
                        q, k_cache, v_cache, seq_lens[first:], table[first:], 0.25, num_splits
                    )
            for first in (0, 1):
                q = torch.randn(2 * (4 - first), 4, 16, generator=gen).to(DEVICE)
                qsl = torch.arange(0, 2 * (5 - first), 2, dtype=torch.int32, device=DEVICE)
                paged_prefill_attention(
                    q, k_cache, v_cache, qsl, seq_lens[first:], table[first:], 2, 0.25
                )
    assert {name: len(keys) for name, keys in log.keys.items()} == {
        "_decode_split_kernel": 1,
        "_decode_merge_kernel": 1,
        "_prefill_attention_kernel": 1,
    }


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> str:
    from tp_engine.testing import build_random_qwen3

    return str(
        build_random_qwen3(
            tmp_path_factory.mktemp("spec"), hidden_size=32, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, intermediate_size=64, max_position_embeddings=64,
            seed=11,
        )
    )  # fmt: skip


def test_serving_after_warmup_compiles_nothing_new(tiny_checkpoint):
    """The engine's start-up (its kernel warm-up) launches every binary; a long run of mixed
    batches after it (chunked prompts next to decodes, block tables of every width, prefill
    rows starting at every offset, a decode-only tail) adds no specialisation of any kernel."""
    from tp_engine import LLM, SamplingParams

    log = SpecializationLog()
    steps: list[tuple[int, int, int]] = []  # (leading decodes, sequences, table width)
    with log.watch():
        llm = LLM(
            tiny_checkpoint,
            attention_backend="triton",
            block_size=4,
            num_kv_blocks=64,
            max_num_seqs=7,
            max_num_batched_tokens=20,
        )
        warm = log.snapshot()
        assert set(warm) >= {
            "_rms_norm_kernel", "_qk_norm_rope_kernel",  # the latter stores K/V too
            "_decode_split_kernel", "_prefill_attention_kernel", "_silu_and_mul_kernel",
        }  # fmt: skip
        runner = llm.engine.runner
        execute = runner.execute

        def recording(plan, *args, **kwargs):
            q_lens = np.diff(plan.query_start_loc)
            lead = int(np.argmax(q_lens != 1)) if (q_lens != 1).any() else plan.num_seqs
            width = -(-int(plan.seq_lens.max()) // 4)  # the step's block-table width
            steps.append((lead, plan.num_seqs, width))
            return execute(plan, *args, **kwargs)

        runner.execute = recording
        g = torch.Generator().manual_seed(3)
        lens = [1, 2, 3, 5, 6, 9, 13, 17, 26, 4]
        prompts = [torch.randint(0, 600, (n,), generator=g).tolist() for n in lens]
        params = [
            SamplingParams(temperature=0.0, max_tokens=2 + i % 7, ignore_eos=True)
            for i in range(len(prompts))
        ]
        llm.generate(prompts, params, use_tqdm=False)
        llm.shutdown()
    assert log.new_since(warm) == {}
    # The run had what used to compile new binaries: mixed steps whose prefill rows start at an
    # offset that is not a multiple of 4 sequences (16 bytes), and many block-table widths.
    mixed = [s for s in steps if 0 < s[0] < s[1]]
    assert any(lead % 4 for lead, _, _ in mixed), steps
    assert len({w for _, _, w in steps}) >= 5, steps
    assert any(lead == n for lead, n, _ in steps), steps  # decode-only steps too
