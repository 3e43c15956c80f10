"""The weight loader fails loudly, naming the tensor, when a checkpoint does not fit the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rank_worker.models.loader import WeightLoadError, load_weights, safetensors_files
from rank_worker.models.qwen3 import Qwen3ForCausalLM
from rank_worker.runner.model_runner import load_hf_config
from rank_worker.tp import TPInfo
from tp_engine.testing import build_random_qwen3

TINY = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
            intermediate_size=64, max_position_embeddings=64)  # fmt: skip


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_qwen3(tmp_path_factory.mktemp("untied"), tie_word_embeddings=False, **TINY)


SINGLE = TPInfo(0, 1)


def _model(model_dir: Path, tp: TPInfo = SINGLE) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM(load_hf_config(model_dir), tp, torch.float32, "cpu")


def _copy_with(src: Path, dst: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    """A copy of checkpoint `src` in `dst` whose single weight file went through `edit`."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_loads_every_parameter_exactly(untied: Path) -> None:
    model = _model(untied)
    # The KV-cache scales are optional checkpoint tensors: absent here, they keep 1.0.
    required = [p for name, p in model.named_parameters() if not name.endswith("kv_scales")]
    for p in required:
        p.data.fill_(float("nan"))
    load_weights(model, untied)
    assert not any(p.isnan().any() for p in required)
    assert all(float(layer.self_attn.kv_scales.min()) == 1.0 for layer in model.model.layers)
    ckpt = load_file(str(untied / "model.safetensors"))
    layer = model.model.layers[1]
    torch.testing.assert_close(
        layer.self_attn.qkv_proj.weight[32:48], ckpt["model.layers.1.self_attn.k_proj.weight"]
    )
    torch.testing.assert_close(model.lm_head.weight, ckpt["lm_head.weight"])


def test_missing_weight_is_named(untied: Path, tmp_path: Path) -> None:
    name = "model.layers.1.self_attn.k_proj.weight"
    broken = _copy_with(untied, tmp_path / "ckpt", lambda t: t.pop(name))
    with pytest.raises(WeightLoadError, match=name.replace(".", r"\.")):
        load_weights(_model(broken), broken)


def test_missing_untied_head_is_named(untied: Path, tmp_path: Path) -> None:
    broken = _copy_with(untied, tmp_path / "ckpt", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(WeightLoadError, match=r"lm_head\.weight"):
        load_weights(_model(broken), broken)


def test_unexpected_weight_is_named(untied: Path, tmp_path: Path) -> None:
    name = "model.layers.0.mlp.extra_proj.weight"
    broken = _copy_with(untied, tmp_path / "ckpt", lambda t: t.update({name: torch.zeros(2)}))
    with pytest.raises(WeightLoadError, match=name.replace(".", r"\.")):
        load_weights(_model(broken), broken)


def test_wrong_shape_is_named(untied: Path, tmp_path: Path) -> None:
    name = "model.layers.0.mlp.down_proj.weight"
    broken = _copy_with(untied, tmp_path / "ckpt", lambda t: t.update({name: torch.zeros(32, 60)}))
    with pytest.raises(WeightLoadError, match=name.replace(".", r"\.")):
        load_weights(_model(broken), broken)


def test_tied_checkpoint_that_also_stores_the_head(tmp_path: Path) -> None:
    tied = build_random_qwen3(tmp_path / "tied", tie_word_embeddings=True, **TINY)
    with_head = _copy_with(
        tied,
        tmp_path / "with_head",
        lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}),
    )
    model = _model(with_head)
    load_weights(model, with_head)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_sharded_checkpoint_in_lower_precision(tmp_path: Path) -> None:
    sharded = build_random_qwen3(
        tmp_path / "sharded",
        tie_word_embeddings=False,
        max_shard_bytes=8_000,
        dtype="bfloat16",
        **TINY,
    )
    files = safetensors_files(sharded)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(files) > 2 and set(index["weight_map"].values()) == {f.name for f in files}
    model = _model(sharded, TPInfo(1, 2))  # rank 1 of 2: exercises shard slicing as well
    load_weights(model, sharded)  # bf16 on disk -> fp32 parameters
    assert model.model.norm.weight.dtype == torch.float32
    assert not any(p.isnan().any() for p in model.parameters())
