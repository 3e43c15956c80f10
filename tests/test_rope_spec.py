"""`RopeSpec`: YaRN read from every config spelling, computed as transformers computes it, and
the maximum length it gives rank 0 and the ranks' cos/sin table."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rank_worker.models.layers import RopeSpec, RotaryEmbedding
from rank_worker.runner.model_runner import load_hf_config
from tp_engine.config import EngineConfig

# The e2e tests' scaling: L0 = 32 keeps prompts longer than the pretraining length cheap.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
SHAPE = dict(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=32)


def hf_config(**rope: object):
    from transformers import Qwen3Config

    return Qwen3Config(**SHAPE, rope_parameters={"rope_theta": 1e4, **YARN, **rope})


@pytest.mark.parametrize(
    "rope",
    [{}, {"mscale": 1.0, "mscale_all_dim": 0.5}, {"attention_factor": 1.3}, {"truncate": False},
     {"beta_fast": 8, "beta_slow": 2}, {"factor": 2.5}],
    ids=["defaults", "mscale", "explicit_factor", "no_truncate", "betas", "factor2.5"],
)  # fmt: skip
def test_inv_freq_and_attention_factor_equal_transformers(rope) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = hf_config(**rope)
    spec = RopeSpec.from_config(config)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    assert torch.equal(spec.inv_freq(), inv_freq)  # bit-equal, fp32
    assert spec.attention_factor == attention_factor


def test_table_equals_transformers_rotary_at_every_position() -> None:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    config = hf_config()
    spec = RopeSpec.from_config(config)
    # The test checkpoint's ramp is not degenerate: frequency 0 kept, 1 blended, 2.. divided.
    low, high = spec.correction_range()
    assert 0 <= low < high < spec.head_dim // 2
    assert spec.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    table = RotaryEmbedding(spec, device="cpu").cos_sin_cache  # [128, 16]
    assert table.shape == (128, 16)  # L0 × factor rows, not max_position_embeddings (32)
    positions = torch.arange(128)[None]
    cos, sin = Qwen3RotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    torch.testing.assert_close(table[:, :8], cos[0, :, :8], rtol=0, atol=1e-6)
    torch.testing.assert_close(table[:, 8:], sin[0, :, :8], rtol=0, atol=1e-6)


def test_every_config_spelling_gives_the_same_spec(tmp_path) -> None:
    from tp_engine.testing import build_random_qwen3, with_rope_scaling

    base = build_random_qwen3(
        tmp_path / "base", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
        intermediate_size=32, max_position_embeddings=32, rope_theta=1e4,
    )  # fmt: skip
    legacy_type = {("type" if k == "rope_type" else k): v for k, v in YARN.items()}
    specs = {
        "rope_parameters": with_rope_scaling(base, tmp_path / "new", YARN),
        "rope_scaling": with_rope_scaling(base, tmp_path / "old", YARN, legacy=True),
        "rope_scaling_type": with_rope_scaling(base, tmp_path / "typ", legacy_type, legacy=True),
    }
    got = {name: RopeSpec.from_config(load_hf_config(path)) for name, path in specs.items()}
    # The same dicts read directly (no transformers in between), as older configs spell them.
    shape = dict(head_dim=16, max_position_embeddings=32)
    got["raw_rope_scaling_type"] = RopeSpec.from_config(
        SimpleNamespace(rope_theta=1e4, rope_scaling=legacy_type, **shape)
    )
    got["raw_rope_parameters"] = RopeSpec.from_config(
        SimpleNamespace(rope_parameters={"rope_theta": 1e4, **YARN}, **shape)
    )
    expected = RopeSpec.from_config(hf_config())
    assert expected.yarn is not None and expected.theta == 1e4
    assert got == dict.fromkeys(got, expected)
    plain = RopeSpec.from_config(load_hf_config(base))
    assert plain.yarn is None and plain.attention_factor == 1.0 and plain.max_positions == 32


def test_max_length_default_and_refusal() -> None:
    spec = RopeSpec.from_config(hf_config())
    assert spec.max_positions == 128  # 32 × 4 beats max_position_embeddings 32
    config = EngineConfig().with_model_defaults(spec.max_positions, spec.max_positions_source)
    assert config.max_model_len == 128
    assert EngineConfig(max_model_len=128).with_model_defaults(spec.max_positions).max_model_len
    with pytest.raises(
        ValueError,
        match=r"max_model_len \(129\) exceeds the model's maximum length 128 \(yarn: "
        r"original_max_position_embeddings 32 × factor 4\)",
    ):
        EngineConfig(max_model_len=129).with_model_defaults(
            spec.max_positions, spec.max_positions_source
        )
    # A config whose max_position_embeddings says more than L0 × factor keeps its own.
    longer = RopeSpec.from_config(
        SimpleNamespace(rope_parameters={"rope_theta": 1e4, **YARN}, head_dim=16,
                        max_position_embeddings=300)
    )  # fmt: skip
    assert longer.max_positions == 300
    assert longer.max_positions_source == "the checkpoint's max_position_embeddings"


@pytest.mark.parametrize("rope_type", ["llama3", "longrope", "dynamic"])
def test_other_rope_types_are_refused_by_name(rope_type) -> None:
    config = SimpleNamespace(
        rope_scaling={"rope_type": rope_type, "factor": 4.0}, rope_theta=1e4, head_dim=16,
        max_position_embeddings=32,
    )  # fmt: skip
    with pytest.raises(ValueError, match=f"RoPE type '{rope_type}' is not supported"):
        RopeSpec.from_config(config)


def test_ranks_refuse_a_max_model_len_past_their_table(tmp_path) -> None:
    # Rank 0 checks first; this guards a runner given more (e.g. a draft model).
    from rank_worker.runner.model_runner import ModelRunner
    from rank_worker.runner_config import RunnerConfig
    from rank_worker.tp import TPInfo
    from tp_engine.testing import build_random_qwen3, with_rope_scaling

    base = build_random_qwen3(
        tmp_path / "base", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
        intermediate_size=32, max_position_embeddings=32, rope_theta=1e4,
    )  # fmt: skip
    yarn = with_rope_scaling(base, tmp_path / "yarn", YARN)
    runner = ModelRunner(yarn, RunnerConfig(max_model_len=128, block_size=4), TPInfo(0, 1), "cpu")
    assert runner.model.model.layers[0].self_attn.rotary.cos_sin_cache.shape == (128, 16)
    with pytest.raises(ValueError, match=r"max_model_len \(129\) exceeds .* maximum length 128"):
        ModelRunner(yarn, RunnerConfig(max_model_len=129, block_size=4), TPInfo(0, 1), "cpu")
    with pytest.raises(ValueError, match=r"max_model_len \(33\) exceeds .* maximum length 32"):
        ModelRunner(base, RunnerConfig(max_model_len=33, block_size=4), TPInfo(0, 1), "cpu")


def test_the_triton_rotary_kernel_reads_the_scaled_table_as_the_torch_path_does() -> None:
    # The attention factor lives in the table, so the kernels need nothing new (interpreted on
    # CPU, tests/conftest.py). Positions on both sides of L0 and the table's last row.
    from kernels.rotary import rotary_embedding

    rotary = RotaryEmbedding(RopeSpec.from_config(hf_config()), device="cpu")
    gen = torch.Generator().manual_seed(4)
    positions = torch.tensor([0, 5, 31, 32, 77, 127])
    q, k = torch.randn(6, 4, 16, generator=gen), torch.randn(6, 2, 16, generator=gen)
    q_ref, k_ref = rotary(positions, q, k)
    q_out, k_out = rotary_embedding(positions, q.clone(), k.clone(), rotary.cos_sin_cache)
    torch.testing.assert_close(q_out, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, k_ref, rtol=1e-5, atol=1e-5)
    # The factor scales the rotated vectors' norms: |rot(x)| = attention_factor · |x|.
    factor = rotary.spec.attention_factor
    torch.testing.assert_close(q_out.norm(dim=-1), factor * q.norm(dim=-1))
