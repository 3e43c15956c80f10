"""Parallel layers in isolation: which shard each rank loads, and config handling.

Weight loaders need no process group (they only slice), so every rank of a TP group can be
constructed in one process and its shard checked against the full tensor.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rank_worker.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RopeSpec,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from rank_worker.models.layers.linear import local_kv_heads
from rank_worker.tp import TPInfo

CPU = dict(dtype=torch.float32, device="cpu")


def _rows(num_heads: int, head_dim: int, hidden: int) -> torch.Tensor:
    """A weight whose every element says its row: row i is filled with i."""
    return torch.arange(num_heads * head_dim).float().unsqueeze(1).expand(-1, hidden).clone()


@pytest.mark.parametrize(
    "size,num_kv_heads,expected_kv_heads",
    [
        (4, 2, [0, 0, 1, 1]),  # replicated: rank r uses KV head r // 2
        (2, 1, [0, 0]),
        (2, 4, [0, 2]),  # split: rank r owns KV heads [2r, 2r+1]
        (1, 2, [0]),
    ],
)
def test_qkv_shards(size: int, num_kv_heads: int, expected_kv_heads: list[int]) -> None:
    num_heads, head_dim, hidden = 8, 2, 3
    q_full = _rows(num_heads, head_dim, hidden)
    k_full = _rows(num_kv_heads, head_dim, hidden) + 1000
    v_full = _rows(num_kv_heads, head_dim, hidden) + 2000
    for rank in range(size):
        layer = QKVParallelLinear(
            hidden, head_dim, num_heads, num_kv_heads, TPInfo(rank, size), **CPU
        )
        for shard_id, full in (("q", q_full), ("k", k_full), ("v", v_full)):
            layer.weight.weight_loader(layer.weight, full, shard_id)
        q_rows = num_heads // size * head_dim
        kv_rows = layer.num_local_kv_heads * head_dim
        w = layer.weight[:, 0]
        assert w[:q_rows].tolist() == list(range(rank * q_rows, (rank + 1) * q_rows))
        first = expected_kv_heads[rank] * head_dim
        assert w[q_rows : q_rows + kv_rows].tolist() == [1000 + first + i for i in range(kv_rows)]
        assert w[q_rows + kv_rows :].tolist() == [2000 + first + i for i in range(kv_rows)]
        # In the unsplit model, this rank's first query head attends with KV head
        # head // (num_heads / num_kv_heads): the replicated head must be that one.
        kv_head_used = (rank * num_heads // size) // (num_heads // num_kv_heads)
        assert 0 <= kv_head_used - expected_kv_heads[rank] < layer.num_local_kv_heads


def test_kv_heads_that_cannot_be_replicated_evenly() -> None:
    with pytest.raises(ValueError, match="not a multiple"):
        local_kv_heads(3, TPInfo(0, 4))
    with pytest.raises(ValueError, match="divisible"):
        local_kv_heads(6, TPInfo(0, 4))


def test_vocab_padding_shards() -> None:
    vocab, hidden, size = 10, 3, 4  # 3 rows per rank; the last rank has 1 real row + 2 padding
    full = torch.arange(vocab).float().unsqueeze(1).expand(-1, hidden).clone()
    for rank in range(size):
        emb = VocabParallelEmbedding(vocab, hidden, TPInfo(rank, size), **CPU)
        emb.weight.weight_loader(emb.weight, full, None)
        expected = [r if r < vocab else 0 for r in range(rank * 3, rank * 3 + 3)]
        assert emb.weight[:, 0].tolist() == expected
        assert emb.padded_num_embeddings == 12


def test_tied_head_shares_the_embedding() -> None:
    emb = VocabParallelEmbedding(10, 4, TPInfo(0, 1), **CPU)
    head = ParallelLMHead(10, 4, TPInfo(0, 1), tie_to=emb, **CPU)
    assert head.weight is emb.weight
    emb.weight.data.copy_(torch.randn(10, 4))
    hidden = torch.randn(3, 4)
    torch.testing.assert_close(head.compute_logits(hidden), hidden @ emb.weight.T)


def test_merged_and_row_parallel_shards() -> None:
    hidden, inter, size = 3, 8, 2
    gate = torch.arange(inter).float().unsqueeze(1).expand(-1, hidden).clone()
    up = gate + 100
    down = torch.arange(inter).float().unsqueeze(0).expand(hidden, -1).clone()
    for rank in range(size):
        tp = TPInfo(rank, size)
        gate_up = MergedColumnParallelLinear(hidden, [inter, inter], tp, **CPU)
        gate_up.weight.weight_loader(gate_up.weight, gate, 0)
        gate_up.weight.weight_loader(gate_up.weight, up, 1)
        mine = list(range(rank * 4, rank * 4 + 4))
        assert gate_up.weight[:, 0].tolist() == mine + [100 + i for i in mine]
        row = RowParallelLinear(inter, hidden, tp, **CPU)
        row.weight.weight_loader(row.weight, down, None)
        assert row.weight[0].tolist() == mine


def test_wrong_checkpoint_shape_is_rejected() -> None:
    layer = RowParallelLinear(8, 3, TPInfo(0, 2), **CPU)
    with pytest.raises(ValueError, match=r"\(3, 9\)"):
        layer.weight.weight_loader(layer.weight, torch.zeros(3, 9), None)


def test_rms_norm_fused_residual() -> None:
    norm = RMSNorm(6, eps=1e-6, **CPU)
    norm.weight.data.copy_(torch.linspace(0.5, 1.5, 6))
    x, residual = torch.randn(4, 6), torch.randn(4, 6)
    normed, new_residual = norm(x, residual)
    s = x + residual
    torch.testing.assert_close(new_residual, s)
    torch.testing.assert_close(
        normed, norm.weight * s * torch.rsqrt(s.pow(2).mean(-1, True) + 1e-6)
    )
    torch.testing.assert_close(norm(s), normed)


def test_rope_theta_both_spellings() -> None:
    shape = dict(head_dim=8, max_position_embeddings=64)
    new = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 5e5}, **shape)
    old = SimpleNamespace(rope_theta=1e4, rope_scaling=None, **shape)
    assert RopeSpec.from_config(new).theta == 5e5
    assert RopeSpec.from_config(old).theta == 1e4


@pytest.mark.parametrize(
    ("config", "name"),
    [
        (SimpleNamespace(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e6}), "dynamic"),
        (SimpleNamespace(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0}), "linear"),
    ],
)
def test_unsupported_rope_scaling_is_refused_by_name(config: SimpleNamespace, name: str) -> None:
    config.head_dim, config.max_position_embeddings = 8, 64
    with pytest.raises(ValueError, match=f"RoPE type '{name}' is not supported"):
        RopeSpec.from_config(config)


# -- the fused path (Triton kernels; interpreted on CPU) against the torch path -----------------

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: only the order of the fp32 row sum differs. bf16: the same rounding points; a last-bit
# difference of the fp32 statistics may tip a bf16 rounding (and the interpreter truncates).
FUSED_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_norm_and_activation_match_the_torch_path(dtype) -> None:
    from rank_worker.models.layers import SiluAndMul

    g = torch.Generator().manual_seed(0)
    kw = dict(dtype=dtype, device=DEVICE)
    torch_norm, fused_norm = RMSNorm(48, 1e-6, **kw), RMSNorm(48, 1e-6, **kw, fused=True)
    weight = (1 + 0.1 * torch.randn(48, generator=g)).to(**kw)
    torch_norm.weight.data.copy_(weight)
    fused_norm.weight.data.copy_(weight)
    x = (3 * torch.randn(5, 48, generator=g)).to(**kw)
    residual = (2 * torch.randn(5, 48, generator=g)).to(**kw)
    torch.testing.assert_close(fused_norm(x), torch_norm(x), **FUSED_TOL[dtype])
    (got, got_res), (ref, ref_res) = fused_norm(x, residual), torch_norm(x, residual)
    # One correctly rounded add (the interpreter truncates bf16 casts instead of rounding).
    exact = dtype == torch.float32 or DEVICE == "cuda"
    torch.testing.assert_close(
        got_res, ref_res, **(dict(atol=0, rtol=0) if exact else FUSED_TOL[dtype])
    )
    torch.testing.assert_close(got, ref, **FUSED_TOL[dtype])
    gate_up = (3 * torch.randn(4, 2 * 40, generator=g)).to(**kw)
    torch.testing.assert_close(
        SiluAndMul(fused=True)(gate_up), SiluAndMul()(gate_up), **FUSED_TOL[dtype]
    )


def test_layer_kernels_follow_the_attention_backend_unless_chosen(monkeypatch) -> None:
    from rank_worker.attention.selection import select_layer_kernels

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for backend, expected in (("torch", "torch"), ("triton", "triton"), ("flash_attn", "triton")):
        assert select_layer_kernels("auto", device=cuda, attention_backend=backend) == expected
    assert select_layer_kernels("torch", device=cuda, attention_backend="triton") == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_layer_kernels("triton", device=cpu, attention_backend="torch") == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_layer_kernels("triton", device=cpu, attention_backend="torch")
    with pytest.raises(ValueError, match="layer_kernels must be one of"):
        select_layer_kernels("cuda", device=cpu, attention_backend="torch")
