"""MoE in the benchmarks: the random checkpoint builder, the real-shape presets behind
`--model 30B-A3B`, and the limit model's expert accounting, by hand."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from benchmarks.limits import ModelShape, Peaks, offline_limit
from benchmarks.models import QWEN3_MOE_PRESETS, QWEN3_PRESETS, preset_name
from tp_engine.testing import build_random_qwen3_moe

TINY = dict(hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
            max_position_embeddings=64, mlp_only_layers=[0])  # fmt: skip


# -- the checkpoint builder -------------------------------------------------------------------


def test_transformers_loads_it_and_greedy_text_varies(tmp_path: Path) -> None:
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    d = build_random_qwen3_moe(tmp_path, vocab_size=700, seed=1, **TINY)
    model, info = Qwen3MoeForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert model.config.num_experts == 8 and model.config.mlp_only_layers == [0]
    assert model.config.intermediate_size == 2 * 16  # dense layers: top_k * expert width
    tok = AutoTokenizer.from_pretrained(d)
    ids = torch.tensor([tok.encode("Tell me a story about the sea.")])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
        eos_token_id=None,
    )[0, ids.shape[1] :]  # fmt: skip
    assert len(set(out.tolist())) >= 4, f"greedy output barely varies: {out.tolist()}"


def test_same_seed_same_bytes_and_sharding(tmp_path: Path) -> None:
    def digest(d: Path) -> str:
        h = hashlib.sha256()
        for f in sorted(d.glob("*.safetensors")):
            h.update(f.read_bytes())
        return h.hexdigest()

    a = build_random_qwen3_moe(tmp_path / "a", seed=3, **TINY)
    b = build_random_qwen3_moe(tmp_path / "b", seed=3, **TINY)
    c = build_random_qwen3_moe(tmp_path / "c", seed=4, **TINY)
    assert digest(a) == digest(b) != digest(c)
    sharded = build_random_qwen3_moe(tmp_path / "s", seed=3, max_shard_bytes=40_000, **TINY)
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1


# -- presets ------------------------------------------------------------------------------------


def test_moe_presets_have_the_released_shapes() -> None:
    a3b, a22b = QWEN3_MOE_PRESETS["30B-A3B"], QWEN3_MOE_PRESETS["235B-A22B"]
    assert (a3b["hidden_size"], a3b["num_layers"], a3b["num_heads"], a3b["num_kv_heads"],
            a3b["moe_intermediate_size"]) == (2048, 48, 32, 4, 768)  # fmt: skip
    assert (a22b["hidden_size"], a22b["num_layers"], a22b["num_heads"], a22b["num_kv_heads"],
            a22b["moe_intermediate_size"]) == (4096, 94, 64, 4, 1536)  # fmt: skip
    for p in (a3b, a22b):
        assert (p["num_experts"], p["num_experts_per_tok"], p["head_dim"]) == (128, 8, 128)
        assert p["norm_topk_prob"] and p["decoder_sparse_step"] == 1 and not p["mlp_only_layers"]
        assert p["vocab_size"] == 151936 and not p["tie_word_embeddings"]
    assert not set(QWEN3_MOE_PRESETS) & set(QWEN3_PRESETS)
    assert preset_name("Qwen/Qwen3-30B-A3B") == "30B-A3B"
    assert preset_name("qwen3-235b-a22b") == "235B-A22B"
    assert preset_name("30B") is None


def test_a_moe_size_name_builds_a_moe_checkpoint(monkeypatch, tmp_path: Path) -> None:
    import benchmarks.models as models

    calls = []
    monkeypatch.setattr(
        models, "cached_random_qwen3", lambda name, **kw: calls.append((name, kw)) or tmp_path
    )
    assert models.resolve_model("Qwen/Qwen3-30B-A3B") == tmp_path
    ((name, kw),) = calls
    assert name.startswith("bench-qwen3-moe-30B-A3B-v")
    assert kw["builder"] is build_random_qwen3_moe and kw["dtype"] == "bfloat16"
    assert kw["num_experts"] == 128 and kw["moe_intermediate_size"] == 768


@pytest.mark.parametrize(
    ("name", "total", "active"), [("30B-A3B", 30.5e9, 3.3e9), ("235B-A22B", 235.1e9, 22.2e9)]
)
def test_preset_parameter_counts_are_the_advertised_ones(name, total, active) -> None:
    """Qwen's model cards: 30.5B total / 3.3B activated, 235B / 22B (embeddings included)."""
    p = QWEN3_MOE_PRESETS[name]
    shape = ModelShape.from_hf_config(
        dict(
            hidden_size=p["hidden_size"], num_hidden_layers=p["num_layers"],
            num_attention_heads=p["num_heads"], num_key_value_heads=p["num_kv_heads"],
            head_dim=p["head_dim"], intermediate_size=8 * p["moe_intermediate_size"],
            vocab_size=p["vocab_size"], num_experts=p["num_experts"],
            num_experts_per_tok=p["num_experts_per_tok"],
            moe_intermediate_size=p["moe_intermediate_size"],
        )
    )  # fmt: skip
    assert shape.num_sparse_layers == p["num_layers"]
    assert shape.weight_params == pytest.approx(total, rel=0.01)
    embedding = p["vocab_size"] * p["hidden_size"]
    assert shape.active_linear_params + shape.lm_head_params + embedding == pytest.approx(
        active, rel=0.02
    )


# -- limit model --------------------------------------------------------------------------------

# hidden 8, 2 layers (layer 0 dense with MLP 16, layer 1 sparse: 4 experts of 6, top 2), 2 query
# heads and 1 KV head of 4, vocab 32, untied head.
TINY_MOE = ModelShape(8, 2, 2, 1, 4, 16, 32, False, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=6, num_sparse_layers=1)  # fmt: skip


def test_moe_shape_counts_by_hand():
    # attention 8*(2+2)*4 + 2*4*8 = 192; dense layer 192 + 3*8*16 = 576; expert 3*8*6 = 144;
    # router 4*8 = 32; sparse layer with all experts 192 + 32 + 4*144 = 800.
    # Norms 2*(8+8+4+4) + 8 = 56, head 256, embedding 256.
    assert TINY_MOE.weight_params == 576 + 800 + 56 + 256 + 256
    assert TINY_MOE.active_linear_params == 576 + 192 + 32 + 2 * 144
    # Distinct experts of B uniform tokens: 4 (1 - (1/2)^B): 2, 3, 3.5 ... -> 4.
    assert [TINY_MOE.expected_experts(b) for b in (1, 2, 3)] == [2.0, 3.0, 3.5]
    assert TINY_MOE.expected_experts(64) == pytest.approx(4.0)
    # A step reads every weight but the experts nobody routes to.
    assert TINY_MOE.decode_weight_params(1) == 1944 - 2 * 144
    assert TINY_MOE.decode_weight_params(2) == 1944 - 1 * 144
    # P = 3: 2*3*1088 linear + 6 causal pairs * 4*2*2*4 + one head row 2*256.
    assert TINY_MOE.prefill_flops(3) == 6528 + 384 + 512
    assert TINY_MOE.decode_flops(4) == 2 * (1088 + 256) + 4 * 2 * 2 * 4 * 4


def test_moe_limit_reads_the_experts_each_step_reaches():
    limit = offline_limit(
        TINY_MOE, [3, 2], [3, 2], max_num_seqs=2, bytes_per_value=2,
        peaks=Peaks(1000.0, 100.0, "test"), tp_size=1,
    )  # fmt: skip
    # Steps of 2 then 1 running sequences (tests/test_bench.py): 3 then 2 experts expected.
    assert limit.decode_weight_bytes == (1800 + 1656) * 2


def test_shape_from_a_moe_config_counts_its_sparse_layers():
    cfg = dict(
        hidden_size=8, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
        head_dim=4, intermediate_size=16, vocab_size=32, num_local_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=6, decoder_sparse_step=2,
        mlp_only_layers=[3],
    )  # fmt: skip
    # Sparse by the step: 1, 3, 5; layer 3 is mlp-only.
    shape = ModelShape.from_hf_config(cfg)
    assert (shape.num_experts, shape.num_sparse_layers, shape.num_dense_layers) == (4, 2, 4)
    dense = ModelShape.from_hf_config({k: v for k, v in cfg.items() if "expert" not in k})
    assert dense.num_sparse_layers == 0 and dense.decode_weight_params(7) == dense.weight_params
