"""The Qwen3-MoE pieces one at a time: where experts go, the router against transformers', the
loader's strictness on expert tensors, the model chosen from config.json, the KV cache of the
MoE shapes, and the expert-parallel switch from the command line down to the runner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rank_worker.models.layers.moe import ExpertPlacement, TopKRouter
from rank_worker.models.loader import WeightLoadError, load_weights
from rank_worker.runner.model_runner import load_hf_config
from rank_worker.tp import TPInfo
from tp_engine.testing import build_random_qwen3_moe

TINY = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
            num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
            max_position_embeddings=64, seed=7)  # fmt: skip


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_qwen3_moe(tmp_path_factory.mktemp("moe"), **TINY)


def _model(model_dir: Path, tp: TPInfo, expert_parallel: bool) -> torch.nn.Module:
    from rank_worker.models.architectures import build_model

    return build_model(
        load_hf_config(model_dir), tp, torch.float32, "cpu", enable_expert_parallel=expert_parallel
    )


def _copy_with(src: Path, dst: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


# -- placement ----------------------------------------------------------------------------------


def test_tensor_parallel_slices_every_expert():
    placements = [ExpertPlacement.for_rank(128, 768, TPInfo(r, 4), False) for r in range(4)]
    assert [(p.first_expert, p.num_local_experts) for p in placements] == [(0, 128)] * 4
    assert [(p.intermediate_start, p.local_intermediate_size) for p in placements] == [
        (0, 192), (192, 192), (384, 192), (576, 192)
    ]  # fmt: skip
    assert placements[2].expert_map("cpu").tolist() == list(range(128))


def test_expert_parallel_places_whole_experts_even_when_ranks_do_not_divide_them():
    placements = [ExpertPlacement.for_rank(6, 16, TPInfo(r, 4), True) for r in range(4)]
    assert [(p.first_expert, p.num_local_experts) for p in placements] == [
        (0, 2), (2, 2), (4, 1), (5, 1)
    ]  # fmt: skip
    assert all(p.local_intermediate_size == 16 for p in placements)
    assert placements[1].expert_map("cpu").tolist() == [-1, -1, 0, 1, -1, -1]
    assert placements[1].local_id(3) == 1 and placements[1].local_id(4) is None
    even = [ExpertPlacement.for_rank(128, 768, TPInfo(r, 8), True) for r in range(8)]
    assert [p.num_local_experts for p in even] == [16] * 8


def test_placements_that_cannot_work_are_refused_clearly():
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(20\).*--enable-expert-parallel"):
        ExpertPlacement.for_rank(8, 20, TPInfo(0, 8), False)
    with pytest.raises(ValueError, match="needs at least 4 experts, the model has 3"):
        ExpertPlacement.for_rank(3, 16, TPInfo(0, 4), True)


# -- router ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_matches_transformers(norm_topk_prob: bool):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(
        hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm_topk_prob
    )
    theirs = Qwen3MoeTopKRouter(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(16, 32, generator=gen))
    ours = TopKRouter(16, 32, 4, norm_topk_prob, device="cpu")
    ours.weight.data.copy_(theirs.weight)
    x = torch.randn(50, 32, generator=gen)
    weights, ids = ours(x)
    _, their_weights, their_ids = theirs(x)
    assert torch.equal(ids, their_ids)
    torch.testing.assert_close(weights, their_weights)
    assert weights.dtype == torch.float32
    if norm_topk_prob:
        torch.testing.assert_close(weights.sum(-1), torch.ones(50))


def test_router_runs_in_fp32_for_bf16_models():
    router = TopKRouter(8, 16, 2, True, device="cpu")
    router.weight.data.normal_()
    assert router.weight.dtype == torch.float32
    weights, ids = router(torch.randn(3, 16).bfloat16())
    assert weights.dtype == torch.float32 and ids.shape == (3, 2)


# -- the experts' three paths ---------------------------------------------------------------------


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_the_experts_three_paths_agree(moe_dir: Path, expert_parallel: bool):
    """The torch path (host-read routing), its graph-safe variant (every expert, weight 0 where
    unused) and the fused kernel, on rank 1 of 2's share of the experts."""
    from kernels.fused_moe import fused_moe

    model = _model(moe_dir, TPInfo(1, 2), expert_parallel)
    load_weights(model, moe_dir)
    block = model.model.layers[1].mlp
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(0))
    weights, ids = block.gate(x)
    local = block.experts.expert_map[ids]
    if expert_parallel:
        assert (local < 0).any() and (local >= 0).any()
    by_expert = block.experts._forward_torch(x, weights, local)
    every = block.experts._forward_every_expert(x, weights, local)
    w13, w2 = block.experts.w13_weight, block.experts.w2_weight
    fused = fused_moe(x, w13, w2, weights, local, all_local=not expert_parallel)
    torch.testing.assert_close(every, by_expert, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fused, by_expert, atol=1e-5, rtol=1e-5)


# -- loading --------------------------------------------------------------------------------------


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_each_rank_loads_its_part_of_the_experts(moe_dir: Path, expert_parallel: bool):
    ckpt = load_file(str(moe_dir / "model.safetensors"))
    for rank in range(4 if expert_parallel else 2):
        tp = TPInfo(rank, 4 if expert_parallel else 2)
        model = _model(moe_dir, tp, expert_parallel)
        load_weights(model, moe_dir)
        experts = model.model.layers[1].mlp.experts
        p = experts.placement
        for local in range(p.num_local_experts):
            e = f"model.layers.1.mlp.experts.{p.first_expert + local}"
            rows = slice(p.intermediate_start, p.intermediate_start + p.local_intermediate_size)
            want_w13 = torch.cat(
                [ckpt[f"{e}.gate_proj.weight"][rows], ckpt[f"{e}.up_proj.weight"][rows]]
            )
            assert torch.equal(experts.w13_weight[local], want_w13)
            assert torch.equal(experts.w2_weight[local], ckpt[f"{e}.down_proj.weight"][:, rows])
        router = model.model.layers[1].mlp.gate.weight
        assert torch.equal(router, ckpt["model.layers.1.mlp.gate.weight"])  # replicated


def test_expert_parallel_never_reads_other_ranks_experts(moe_dir: Path, monkeypatch):
    import rank_worker.models.loader as loader

    read: list[str] = []
    real_safe_open = loader.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self._f = real_safe_open(*args, **kwargs)

        def __enter__(self):
            self._inner = self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def keys(self):
            return self._inner.keys()

        def get_slice(self, name):
            return self._inner.get_slice(name)

        def get_tensor(self, name):
            read.append(name)
            return self._inner.get_tensor(name)

    monkeypatch.setattr(loader, "safe_open", Recording)
    load_weights(_model(moe_dir, TPInfo(3, 4), True), moe_dir)  # rank 3 of 4 holds expert 5
    experts_read = {n.split(".")[5] for n in read if ".mlp.experts." in n}
    assert experts_read == {"5"}


def test_a_missing_expert_tensor_is_named_on_every_rank(moe_dir: Path, tmp_path: Path):
    name = "model.layers.0.mlp.experts.4.down_proj.weight"
    broken = _copy_with(moe_dir, tmp_path / "ckpt", lambda t: t.pop(name))
    for tp, ep in ((TPInfo(0, 1), False), (TPInfo(0, 2), True)):  # rank 0 of 2 does not hold 4
        with pytest.raises(WeightLoadError, match=name.replace(".", r"\.")):
            load_weights(_model(broken, tp, ep), broken)


def test_fused_in_memory_expert_layout_is_not_a_checkpoint(moe_dir: Path, tmp_path: Path):
    """transformers 5 fuses experts in memory (`mlp.experts.gate_up_proj`); published
    checkpoints store one tensor per expert, and only that is accepted."""

    def fuse(t):
        p = "model.layers.0.mlp.experts"
        t[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([t.pop(f"{p}.{e}.gate_proj.weight"), t.pop(f"{p}.{e}.up_proj.weight")])
             for e in range(6)]
        )  # fmt: skip
        t[f"{p}.down_proj"] = torch.stack([t.pop(f"{p}.{e}.down_proj.weight") for e in range(6)])

    fused = _copy_with(moe_dir, tmp_path / "fused", fuse)
    with pytest.raises(WeightLoadError, match=r"unexpected checkpoint tensors.*gate_up_proj"):
        load_weights(_model(fused, TPInfo(0, 1), False), fused)


def test_another_ranks_expert_of_the_wrong_shape_is_refused(moe_dir: Path, tmp_path: Path):
    name = "model.layers.1.mlp.experts.0.up_proj.weight"
    bad = _copy_with(moe_dir, tmp_path / "bad", lambda t: t.update({name: torch.zeros(8, 32)}))
    # Rank 3 of 4 does not hold expert 0: the shape is checked from the file header.
    with pytest.raises(WeightLoadError, match=r"up_proj.*\(8, 32\).*\(16, 32\)"):
        load_weights(_model(bad, TPInfo(3, 4), True), bad)


# -- model selection, KV cache, configuration ---------------------------------------------------


def test_the_model_class_comes_from_config_json(moe_dir: Path):
    from transformers import Qwen3Config, Qwen3MoeConfig

    from rank_worker.models.architectures import model_class_for
    from rank_worker.models.qwen3 import Qwen3ForCausalLM
    from rank_worker.models.qwen3_moe import Qwen3MoeForCausalLM

    assert model_class_for(load_hf_config(moe_dir)) is Qwen3MoeForCausalLM
    assert model_class_for(Qwen3Config()) is Qwen3ForCausalLM  # no architectures: model_type
    assert model_class_for(Qwen3MoeConfig()) is Qwen3MoeForCausalLM
    other = Qwen3Config()
    other.architectures, other.model_type = ["LlamaForCausalLM"], "llama"
    with pytest.raises(ValueError, match=r"unsupported model.*Qwen3MoeForCausalLM"):
        model_class_for(other)


def test_sparse_layers_follow_transformers_rule():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (
        Qwen3MoeDecoderLayer,
        Qwen3MoeSparseMoeBlock,
    )

    from rank_worker.models.qwen3_moe import is_sparse_layer

    config = Qwen3MoeConfig(
        hidden_size=16, num_hidden_layers=7, num_attention_heads=2, num_key_value_heads=1,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, intermediate_size=8,
        decoder_sparse_step=2, mlp_only_layers=[5],
    )  # fmt: skip
    theirs = [
        isinstance(Qwen3MoeDecoderLayer(config, i).mlp, Qwen3MoeSparseMoeBlock) for i in range(7)
    ]
    assert [is_sparse_layer(config, i) for i in range(7)] == theirs
    assert theirs == [False, True, False, True, False, False, False]


@pytest.mark.parametrize(("tp_size", "local_kv_heads"), [(1, 4), (2, 2), (4, 1), (8, 1)])
def test_kv_cache_of_the_30b_a3b_shape(tp_size: int, local_kv_heads: int):
    from transformers import Qwen3MoeConfig

    from rank_worker.kv.cache import KVCacheSpec

    config = Qwen3MoeConfig(
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
    )  # fmt: skip
    spec = KVCacheSpec.for_model(config, TPInfo(0, tp_size), 16, torch.bfloat16)
    # 4 KV heads: split at TP <= 4, each replicated on 2 ranks at TP = 8.
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (48, local_kv_heads, 128)
    assert spec.bytes_per_block == 2 * 48 * 16 * local_kv_heads * 128 * 2


def test_a_dense_model_ignores_expert_parallelism(tmp_path: Path):
    from rank_worker.models.qwen3 import Qwen3ForCausalLM
    from tp_engine.testing import build_random_qwen3

    dense = build_random_qwen3(
        tmp_path, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    assert type(_model(dense, TPInfo(0, 1), True)) is Qwen3ForCausalLM


def test_the_flag_reaches_the_runner_from_every_front_end(moe_dir: Path):
    import dataclasses
    import importlib.util

    from tp_engine.config import EngineConfig
    from tp_engine.config.flags import engine_kwargs
    from tp_engine.executor.rank_config import runner_config_for
    from tp_engine.server.args import build_parser, engine_config

    assert EngineConfig().enable_expert_parallel is False
    args = build_parser().parse_args(["--model", str(moe_dir), "--enable-expert-parallel"])
    config = engine_config(args, tp_size=2)
    assert config.enable_expert_parallel is True
    resolved = dataclasses.replace(config, max_model_len=64)
    assert runner_config_for(resolved).enable_expert_parallel is True
    # The offline scripts read the same flag table (`tp_engine.config.flags`) and hand the
    # parsed values to `LLM(...)` with `engine_kwargs`.
    for script in ("launch/generate.py", "launch/bench.py"):
        path = Path(__file__).resolve().parents[1] / script
        spec = importlib.util.spec_from_file_location(f"_script_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        parsed = module.parse_args(["--model", str(moe_dir), "--enable-expert-parallel"])
        exclude = getattr(module, "ENGINE_FLAGS_SPELT_HERE", ())
        assert engine_kwargs(parsed, exclude=exclude)["enable_expert_parallel"] is True, script


def test_config_json_is_as_published(moe_dir: Path):
    config = json.loads((moe_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["model_type"] == "qwen3_moe"
    assert config["num_experts"] == 6 and "num_local_experts" not in config
    assert load_hf_config(moe_dir).num_experts == 6
