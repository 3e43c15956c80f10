"""The triton and flash_attn backends against the torch reference, and how a backend is chosen.

CPU: the Triton kernels run under the interpreter (TRITON_INTERPRET=1, tiny sizes); flash-attn
is replaced by a stand-in that implements its documented semantics in plain torch, which
checks how the backend calls it (layouts, cumulative lengths, causal alignment), not the
package itself. GPU (`gpu` marker): the same cases natively, in bf16 too, and the real
flash-attn when it is installed.
"""

from __future__ import annotations

import os
import sys
import types
from dataclasses import dataclass

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # must precede the first `import kernels` (tests/conftest too)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rank_worker.attention import selection
from rank_worker.attention.backend import AttentionBackend
from rank_worker.attention.metadata import AttentionMetadata
from rank_worker.attention.selection import get_backend
from tp_engine.config import EngineConfig

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
GPU_DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu)]
# Where the kernel tests below run: interpreted on CPU, natively where there is a GPU (the
# kernels are then compiled and refuse CPU tensors).
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# -- selection -------------------------------------------------------------------------------


def _select(name: str, device: torch.device = CPU, block_size: int = 16, dtype=torch.bfloat16):
    return selection.select_backend(name, device=device, block_size=block_size, dtype=dtype)


def test_auto_picks_torch_on_cpu_and_triton_on_gpu(monkeypatch):
    monkeypatch.setattr(selection, "flash_attn_importable", lambda: False)
    assert _select("auto", CPU) == "torch"
    assert _select("auto", CUDA) == "triton"


def test_auto_picks_flash_attn_only_when_all_its_needs_are_met(monkeypatch):
    monkeypatch.setattr(selection, "flash_attn_importable", lambda: True)
    assert _select("auto", CUDA, block_size=256) == "flash_attn"
    assert _select("auto", CUDA, block_size=512, dtype=torch.float16) == "flash_attn"
    assert _select("auto", CUDA, block_size=16) == "triton"  # block size
    assert _select("auto", CUDA, block_size=256, dtype=torch.float32) == "triton"  # dtype
    assert _select("auto", CPU, block_size=256) == "torch"  # device


def test_explicit_choices_that_can_run(monkeypatch):
    monkeypatch.setattr(selection, "flash_attn_importable", lambda: True)
    assert _select("torch", CUDA) == "torch"
    assert _select("flash_attn", CUDA, block_size=256) == "flash_attn"
    assert _select("triton", CUDA) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _select("triton", CPU) == "triton"


@pytest.mark.parametrize(
    ("name", "device", "block_size", "dtype", "installed", "message"),
    [
        ("flash_attn", CUDA, 256, torch.bfloat16, False, "flash_attn package is not installed"),
        ("flash_attn", CUDA, 16, torch.bfloat16, True, "multiple of 256, got block_size=16"),
        ("flash_attn", CUDA, 256, torch.float32, True, "float16 or bfloat16 only"),
        ("flash_attn", CPU, 256, torch.bfloat16, True, "needs a CUDA device"),
        ("triton", CPU, 16, torch.float32, True, "TRITON_INTERPRET=1"),
        ("paged", CUDA, 16, torch.float32, True, "must be one of"),
    ],
)
def test_impossible_choices_say_why(
    monkeypatch, name, device, block_size, dtype, installed, message
):
    monkeypatch.setattr(selection, "flash_attn_importable", lambda: installed)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=message):
        _select(name, device, block_size, dtype)


def test_engine_config_checks_the_name_and_flash_attn_block_size():
    assert EngineConfig().attention_backend == "auto"
    assert EngineConfig(attention_backend="flash_attn", block_size=256).block_size == 256
    with pytest.raises(ValueError, match=r"^attention_backend must be one of"):
        EngineConfig(attention_backend="xformers")
    with pytest.raises(ValueError, match=r"^attention_backend 'flash_attn' needs a block_size"):
        EngineConfig(attention_backend="flash_attn", block_size=16)


def test_runner_config_carries_the_choice_to_every_rank():
    from rank_worker.runner_config import RunnerConfig
    from tp_engine.executor.rank_config import runner_config_for

    config = EngineConfig(attention_backend="triton", max_model_len=64)
    runner_config = runner_config_for(config)
    assert runner_config.attention_backend == "triton"
    assert RunnerConfig.from_dict(runner_config.to_dict()) == runner_config
    assert RunnerConfig(max_model_len=8, block_size=4).attention_backend == "auto"


def test_generate_has_the_flags():
    from launch.generate import parse_args

    args = parse_args(["--attention-backend", "triton", "--enforce-eager"])
    assert (args.attention_backend, args.enforce_eager) == ("triton", True)
    assert parse_args([]).attention_backend == "auto"


# -- attention cases -------------------------------------------------------------------------


@dataclass
class Case:
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, KV, D] this step's new K
    value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, KV, D], cached prefixes already written
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float


# (context length after the step, new tokens); block ids are handed out shuffled, so no
# sequence's blocks are contiguous.
CASES = {
    # One token each, contexts of 1, a block's worth, one past a block boundary, several blocks.
    "decode_only": [(1, 1), (4, 1), (5, 1), (17, 1), (33, 1)],
    # A plain prefill, a prompt after a cached prefix of 8, a later chunk, decodes, a 1-token
    # prompt: every row shape in one batch.
    "mixed": [(9, 9), (13, 5), (20, 7), (7, 1), (12, 1), (1, 1)],
    # As the scheduler lays a step out: running decodes first, then prefill chunks and a new
    # 1-token prompt (which is not a leading decode).
    "decodes_first": [(7, 1), (40, 1), (12, 1), (9, 9), (13, 5), (1, 1)],
    # Prompts whose first blocks are cached (prefix hit): only their tails are computed.
    "prefix_cached": [(12, 4), (17, 1 + 8), (30, 3)],
    # The first and the second chunk of two chunked prompts.
    "chunked": [(6, 6), (23, 11)],
}


def make_case(
    lens: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n, _ in lens]
    num_blocks = sum(blocks_needed) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for nb in blocks_needed:
        tables.append(perm[start : start + nb])
        start += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Random, not zero, everywhere: a kernel that reads a slot it should not changes the result.
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    slots, qsl = [], [0]
    for (n, q), table in zip(lens, tables, strict=True):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(n - q, n)]
        qsl.append(qsl[-1] + q)
    num_tokens = qsl[-1]
    width = max(blocks_needed)
    block_table = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, table in enumerate(tables):
        block_table[i, : len(table)] = torch.tensor(table)
    qsl_host = np.array(qsl, dtype=np.int32)
    seq_lens_host = np.array([n for n, _ in lens], dtype=np.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.from_numpy(qsl_host).to(device),
        seq_lens=torch.from_numpy(seq_lens_host).to(device),
        block_table=block_table.to(device),
        max_query_len=int(np.diff(qsl_host).max()),
        max_seq_len=int(seq_lens_host.max()),
        query_start_loc_host=qsl_host,
        seq_lens_host=seq_lens_host,
    )

    def rand(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen).to(device=device, dtype=dtype)

    return Case(
        query=rand(num_tokens, num_heads, head_dim),
        key=rand(num_tokens, num_kv_heads, head_dim),
        value=rand(num_tokens, num_kv_heads, head_dim),
        k_cache=k_cache.to(device=device, dtype=dtype),
        v_cache=v_cache.to(device=device, dtype=dtype),
        meta=meta,
        scale=head_dim**-0.5,
    )


def run_backend(backend: AttentionBackend, case: Case) -> tuple[torch.Tensor, ...]:
    """(output, k_cache, v_cache) after store + attend on private copies of the caches."""
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    out = backend.forward(
        case.query, case.key, case.value, (k_cache, v_cache), case.meta, case.scale
    )
    return out, k_cache, v_cache


# fp32: only the summation order differs (online softmax in tiles vs one softmax), ~1e-6.
# bf16: both compute in fp32 and round the output to bf16 (8 mantissa bits, ~4e-3 relative),
# so outputs of magnitude ~1 may differ by one bf16 ulp.
TOLERANCES = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _assert_backend_matches_torch(
    name: str, case_name: str, heads: tuple[int, int], head_dim: int, block_size: int, dtype, device
) -> None:
    case = make_case(CASES[case_name], *heads, head_dim, block_size, dtype, device)
    out, k_cache, v_cache = run_backend(get_backend(name), case)
    ref, k_ref, v_ref = run_backend(get_backend("torch"), case)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0)  # stores are copies
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])


@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)], ids=lambda h: f"h{h[0]}kv{h[1]}")
def test_triton_matches_torch(case_name, heads):
    _assert_backend_matches_torch("triton", case_name, heads, 16, 4, torch.float32, KERNEL_DEVICE)


def test_triton_matches_torch_bf16_wide_heads():
    _assert_backend_matches_torch("triton", "mixed", (4, 2), 32, 16, torch.bfloat16, KERNEL_DEVICE)


@pytest.mark.parametrize("device", GPU_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("block_size", [16, 256])
def test_triton_matches_torch_gpu(case_name, dtype, device, block_size):
    # Qwen3's real geometry: head_dim 128, 8 query heads per KV head.
    _assert_backend_matches_torch("triton", case_name, (16, 2), 128, block_size, dtype, device)


def test_decode_only_batches_take_the_decode_kernel(monkeypatch):
    from rank_worker.attention import triton_plan

    calls = []
    for kernel in ("plan_decode_attention", "plan_prefill_attention"):
        real = getattr(triton_plan, kernel)

        def spy(*args, _real=real, _name=kernel, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(triton_plan, kernel, spy)
    backend = get_backend("triton")
    for case_name in ("decode_only", "mixed", "decodes_first"):
        case = make_case(CASES[case_name], 4, 2, 16, 4, torch.float32, KERNEL_DEVICE)
        run_backend(backend, case)
    assert calls == [
        "plan_decode_attention",  # decode_only
        "plan_prefill_attention",  # mixed: no leading decodes, one prefill launch
        "plan_prefill_attention",  # decodes_first: the rest...
        "plan_decode_attention",  # ...and the 3 leading decodes
    ]


# -- flash_attn through a stand-in -----------------------------------------------------------


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q `[q_len, H, D]`; k/v `[L, KV, D]`; causal mask aligned to the bottom right."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()
    scores = torch.einsum("qhd,lhd->hql", q.float(), k) * scale
    k_pos = torch.arange(k.shape[0], device=q.device)
    q_pos = k_pos[k.shape[0] - q.shape[0] :].unsqueeze(1)
    scores = scores.masked_fill(k_pos.unsqueeze(0) > q_pos, float("-inf"))
    return torch.einsum("hql,lhd->qhd", scores.softmax(-1), v).to(q.dtype)


def _paged(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    pos = torch.arange(length, device=cache.device)
    return cache[table.long()[pos // cache.shape[1]], pos % cache.shape[1]]


def fake_flash_attn() -> types.ModuleType:
    """flash-attn 2's two paged entry points as documented, in plain torch, with its checks."""

    def check(k_cache, block_table, scale, causal):
        assert k_cache.shape[1] % 256 == 0, "page_block_size must be a multiple of 256"
        assert block_table.dtype == torch.int32 and causal and scale is not None

    def with_kvcache(q, k_cache, v_cache, *, cache_seqlens, block_table, softmax_scale, causal):
        check(k_cache, block_table, softmax_scale, causal)
        assert q.dim() == 4 and cache_seqlens.dtype == torch.int32
        out = torch.empty_like(q)  # [B, q_len, H, D]
        for b, n in enumerate(cache_seqlens.tolist()):
            k, v = _paged(k_cache, block_table[b], n), _paged(v_cache, block_table[b], n)
            out[b] = _dense(q[b], k, v, softmax_scale)
        return out

    def varlen(
        q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
        causal, block_table,
    ):  # fmt: skip
        check(k, block_table, softmax_scale, causal)
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        lens_q, lens_k = cu_seqlens_q.diff().tolist(), cu_seqlens_k.diff().tolist()
        assert max(lens_q) == max_seqlen_q and max(lens_k) == max_seqlen_k
        out = torch.empty_like(q)  # [T, H, D]
        for b, (start, n) in enumerate(zip(cu_seqlens_q.tolist(), lens_k, strict=False)):
            rows = slice(start, start + lens_q[b])
            keys, values = _paged(k, block_table[b], n), _paged(v, block_table[b], n)
            out[rows] = _dense(q[rows], keys, values, softmax_scale)
        return out

    module = types.ModuleType("flash_attn")
    module.flash_attn_with_kvcache = with_kvcache
    module.flash_attn_varlen_func = varlen
    return module


@pytest.mark.parametrize("case_name", ["decode_only", "mixed"])
def test_flash_attn_backend_calls_match_torch(monkeypatch, case_name):
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn())
    # Contexts that span several 256-token pages.
    lens = [(n * 23, q if q == 1 else q * 23) for n, q in CASES[case_name][:4]]
    case = make_case(lens, 4, 2, 16, 256, torch.float32, KERNEL_DEVICE)
    out, k_cache, v_cache = run_backend(get_backend("flash_attn"), case)
    ref, k_ref, v_ref = run_backend(get_backend("torch"), case)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case_name", list(CASES))
def test_real_flash_attn_matches_torch_gpu(case_name, dtype):
    pytest.importorskip("flash_attn")
    lens = [(n * 23, q if q == 1 else q * 23) for n, q in CASES[case_name]]
    case = make_case(lens, 16, 2, 128, 256, dtype, "cuda")
    out, _, _ = run_backend(get_backend("flash_attn"), case)
    ref, _, _ = run_backend(get_backend("torch"), case)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.bfloat16])


# -- end to end on CPU -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> str:
    from tp_engine.testing import build_random_qwen3

    return str(
        build_random_qwen3(
            tmp_path_factory.mktemp("tiny"), hidden_size=32, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, intermediate_size=64, max_position_embeddings=64,
            seed=5,
        )
    )  # fmt: skip


def test_llm_triton_backend_matches_torch(tiny_checkpoint):
    """Greedy tokens of the whole engine (on CPU under the interpreter, natively on a GPU):
    prefills, a prompt chunked by the 16-token budget, prefix-cache hits (prompts sharing 8
    tokens, run twice) and decodes, in fp32."""
    from tp_engine import LLM, SamplingParams

    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 600, (8,), generator=g).tolist()
    prompts = [[7], list(range(100, 105)), shared + [1, 2, 3], shared + [9] * 12]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        with LLM(
            tiny_checkpoint,
            attention_backend=backend,
            block_size=4,
            num_kv_blocks=48,
            max_num_seqs=4,
            max_num_batched_tokens=16,
        ) as llm:
            assert llm.engine.runner.attention_backend.name == backend
            runs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(2)]
        assert sum(o.num_cached_tokens for o in runs[1]) > 0  # the second run hit the cache
        results[backend] = [[o.outputs[0].token_ids for o in run] for run in runs]
    assert results["triton"] == results["torch"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton runs natively here")
def test_llm_refuses_triton_on_cpu_without_the_interpreter(tiny_checkpoint, monkeypatch):
    from tp_engine import LLM

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    # A configuration refused at start-up reaches the caller as the ValueError it is.
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        LLM(tiny_checkpoint, attention_backend="triton", num_kv_blocks=8)


def test_llm_refuses_flash_attn_with_small_blocks(tiny_checkpoint):
    from tp_engine import LLM

    with pytest.raises(ValueError, match="multiple of 256"):
        LLM(tiny_checkpoint, attention_backend="flash_attn", num_kv_blocks=8)
