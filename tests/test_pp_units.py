"""Pipeline parallelism's parts, in this process (no ranks started): the layer split, each
stage's share of the model (layers, embedding, norm, head, weights, KV cache), stages chained
by hand against the whole model, and what pipeline parallelism refuses, by name.

The end-to-end runs over real ranks are `tests/test_pp_e2e.py`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rank_worker.models.architectures import build_model
from rank_worker.models.loader import load_weights
from rank_worker.models.model_spec import load_hf_config
from rank_worker.pp import PipelineInfo, PipelineStage, StageHandoff, layer_partition
from rank_worker.tp import TPInfo
from tp_engine.config import EngineConfig
from tp_engine.testing import build_random_qwen3, build_random_qwen3_moe

SINGLE = TPInfo(0, 1)
DENSE = dict(hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
             intermediate_size=64, max_position_embeddings=64)  # fmt: skip


# -- the layer split ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_layers", "pp", "expected"),
    [
        (4, 2, [(0, 2), (2, 4)]),
        (20, 4, [(0, 5), (5, 10), (10, 15), (15, 20)]),
        # vLLM's get_pp_indices: the remainder goes to the stages just before the last.
        (3, 2, [(0, 2), (2, 3)]),
        (10, 4, [(0, 2), (2, 5), (5, 8), (8, 10)]),
        (5, 4, [(0, 1), (1, 2), (2, 4), (4, 5)]),
        (7, 1, [(0, 7)]),
    ],
)
def test_even_split_follows_vllm(num_layers: int, pp: int, expected: list) -> None:
    assert layer_partition(num_layers, pp) == expected


def test_explicit_partition_and_its_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    from tp_engine.executor.rank_config import pp_layer_partition

    assert layer_partition(4, 2, (3, 1)) == [(0, 3), (3, 4)]
    for bad in ((2, 1), (4, 0), (1, 1, 2)):
        with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
            layer_partition(4, 2, bad)
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        layer_partition(2, 3)
    # The environment's partition (vLLM's VLLM_PP_LAYER_PARTITION), unless the config gives one.
    monkeypatch.setenv("TP_ENGINE_PP_LAYER_PARTITION", "1,3")
    assert pp_layer_partition(EngineConfig(pipeline_parallel_size=2)) == (1, 3)
    config = EngineConfig(pipeline_parallel_size=2, pp_layer_partition="2,2")
    assert config.pp_layer_partition == (2, 2) and pp_layer_partition(config) == (2, 2)
    monkeypatch.setenv("TP_ENGINE_PP_LAYER_PARTITION", "1;3")
    with pytest.raises(ValueError, match="TP_ENGINE_PP_LAYER_PARTITION"):
        pp_layer_partition(EngineConfig(pipeline_parallel_size=2))


def test_world_ranks_are_stage_major() -> None:
    # TP = 1 per stage needs no process group: the facts of every rank of a 1 x 3 world.
    stages = [PipelineInfo.build(TPInfo(r, 3), 3, 6) for r in range(3)]
    assert [(p.stage.index, p.stage.start, p.stage.end) for p in stages] == [
        (0, 0, 2), (1, 2, 4), (2, 4, 6),
    ]  # fmt: skip
    assert all(p.tp.size == 1 and p.tp.rank == 0 for p in stages)
    assert [p.output_rank for p in stages] == [2, 2, 2]
    assert (stages[1].prev_rank, stages[1].next_rank) == (0, 2)
    assert EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=3).world_size == 6
    with pytest.raises(ValueError, match="do not divide"):
        PipelineInfo.build(TPInfo(0, 3), 2, 4)


# -- each stage's share of the model ---------------------------------------------------------


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_qwen3(tmp_path_factory.mktemp("tied"), tie_word_embeddings=True, **DENSE)


def _stage_model(model_dir: Path, stage: PipelineStage | None) -> torch.nn.Module:
    model = build_model(load_hf_config(model_dir), SINGLE, torch.float32, "cpu", stage=stage)
    load_weights(model, model_dir)  # strict: every parameter once, no tensor without a home
    return model.eval()


def test_each_stage_holds_and_loads_only_its_share(tied: Path) -> None:
    ckpt = load_file(str(tied / "model.safetensors"))
    first = _stage_model(tied, PipelineStage(0, 2, 0, 1, 3))
    last = _stage_model(tied, PipelineStage(1, 2, 1, 3, 3))
    first_names = {name for name, _ in first.named_parameters()}
    last_names = {name for name, _ in last.named_parameters()}
    assert first_names and last_names and not first_names & last_names
    assert {n.split(".")[2] for n in first_names if n.startswith("model.layers.")} == {"0"}
    assert {n.split(".")[2] for n in last_names if n.startswith("model.layers.")} == {"1", "2"}
    assert first.model.embed_tokens is not None and first.head is None and first.model.norm is None
    assert last.model.embed_tokens is None and last.head is not None
    # A tied head on a last stage without the embedding: its own copy of the embedding table.
    torch.testing.assert_close(last.lm_head.weight, ckpt["model.embed_tokens.weight"])
    torch.testing.assert_close(first.model.embed_tokens.weight, ckpt["model.embed_tokens.weight"])
    torch.testing.assert_close(
        last.model.layers[2].mlp.down_proj.weight, ckpt["model.layers.2.mlp.down_proj.weight"]
    )
    # Together the stages hold every parameter of the whole model, once (the tied head aside).
    whole = {name for name, _ in _stage_model(tied, None).named_parameters()}
    assert first_names | last_names == whole | {"lm_head.weight"}


@pytest.mark.parametrize(("world_rank", "layers"), [(0, range(0, 2)), (1, range(2, 3))])
def test_each_stage_runner_sizes_its_own_cache(tied: Path, world_rank: int, layers: range) -> None:
    """A runner of each stage of TP 1 x PP 2 (no process group needed: TP 1 per stage makes no
    group, and nothing here is a collective): its cache holds its stage's layers only, so its
    blocks are smaller where it holds fewer layers (the world's minimum then decides)."""
    from rank_worker.runner.model_runner import ModelRunner
    from rank_worker.runner_config import RunnerConfig

    config = RunnerConfig(max_model_len=64, block_size=4, pipeline_parallel_size=2)
    runner = ModelRunner(tied, config, TPInfo(world_rank, 2), "cpu")
    assert runner.pipe.stage.layers == layers and runner.world.rank == world_rank
    assert (runner.tp.rank, runner.tp.size) == (0, 1)
    assert runner.kv_spec.num_layers == len(layers)
    whole = ModelRunner(tied, RunnerConfig(max_model_len=64, block_size=4), SINGLE, "cpu")
    per_layer = whole.kv_spec.bytes_per_block // 3
    assert runner.kv_spec.bytes_per_block == per_layer * len(layers)
    runner.init_kv_cache(5)
    assert len(runner.kv_caches) == len(layers)
    assert all(k.shape[0] == 5 and v.shape[0] == 5 for k, v in runner.kv_caches)
    held = {int(n.split(".")[2]) for n, _ in runner.model.named_parameters() if ".layers." in n}
    assert held == set(layers)
    runner.release()
    whole.release()


def _forward_through_stages(model_dir: Path, partition: list[tuple[int, int]]) -> torch.Tensor:
    """Every position's logits of one prompt, each stage's model run on the previous one's hand-off
    (what the ranks' send and receive carry), with its own KV cache."""
    from rank_worker.inputs.block_tables import BlockTables
    from rank_worker.inputs.input_prep import prepare_inputs
    from rank_worker.inputs.synthetic_plans import synthetic_plan
    from rank_worker.kv.cache import KVCacheSpec, allocate_kv_cache

    hf_config = load_hf_config(model_dir)
    # One 9-token prompt over blocks 0..2, the logits of every position.
    plan = synthetic_plan([(0, 9, [0, 1, 2])], np.arange(9, dtype=np.int32))
    ids = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, hf_config.vocab_size, (9,), generator=ids).numpy().astype(np.int32)
    plan = dataclasses.replace(plan, input_ids=tokens)
    inputs = prepare_inputs(plan, BlockTables(plan.num_seqs, 3, 4, "cpu"))
    handoff = None
    for index, (start, end) in enumerate(partition):
        stage = PipelineStage(index, len(partition), start, end, hf_config.num_hidden_layers)
        model = _stage_model(model_dir, stage)
        spec = KVCacheSpec.for_model(hf_config, SINGLE, 4, torch.float32, end - start)
        caches = allocate_kv_cache(spec, 4, "cpu")
        assert len(caches) == end - start  # this stage's layers' blocks only
        with torch.inference_mode():
            out = model(inputs.input_ids, inputs.positions, inputs.meta, caches, handoff)
        if index < len(partition) - 1:
            assert isinstance(out, StageHandoff)
            handoff = StageHandoff(out.hidden.clone(), out.residual.clone())
    return model.compute_logits(out[inputs.logits_indices])


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_stages_chained_equal_the_whole_model(tmp_path: Path, tied: Path, moe: bool) -> None:
    model_dir = tied
    if moe:
        model_dir = build_random_qwen3_moe(
            tmp_path / "moe", hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
            head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            max_position_embeddings=64, seed=3,
        )  # fmt: skip
    whole = _forward_through_stages(model_dir, [(0, 3)])
    for partition in ([(0, 2), (2, 3)], [(0, 1), (1, 3)], [(0, 1), (1, 2), (2, 3)]):
        torch.testing.assert_close(_forward_through_stages(model_dir, partition), whole)


# -- what pipeline parallelism refuses, by name -----------------------------------------------


@pytest.mark.parametrize(
    ("fields", "feature"),
    [
        ({"speculative_config": {"method": "draft_model", "model": "/d", "num_speculative_tokens": 2}},
         "speculative decoding with a draft model"),
        ({"speculative_config": {"method": "eagle3", "model": "/h", "num_speculative_tokens": 2}},
         "or an EAGLE-3 head"),
        ({"kv_offloading_size": 0.5}, "host-memory KV tier"),
    ],
)  # fmt: skip
def test_config_refuses_what_pp_does_not_support(fields: dict, feature: str) -> None:
    EngineConfig(**fields)  # fine without pipeline parallelism
    with pytest.raises(ValueError, match=rf"{feature}.*pipeline_parallel_size=2"):
        EngineConfig(pipeline_parallel_size=2, **fields)
    # n-gram drafts work under pipeline parallelism (tests/test_pp_engines.py runs them).
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    EngineConfig(pipeline_parallel_size=2, speculative_config=ngram)


def test_pooling_models_are_refused() -> None:
    from types import SimpleNamespace

    from tp_engine.engine import _check_pooling_config

    embedder = SimpleNamespace(is_pooling=True, task="embed")
    _check_pooling_config(embedder, EngineConfig())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"pooling models \('embed'\).*pipeline_parallel_size=2"):
        _check_pooling_config(embedder, EngineConfig(pipeline_parallel_size=2))  # type: ignore[arg-type]
    generator = SimpleNamespace(is_pooling=False, task="generate")
    _check_pooling_config(generator, EngineConfig(pipeline_parallel_size=2))  # type: ignore[arg-type]


def test_server_refuses_what_pp_does_not_support() -> None:
    from tp_engine.server.args import build_parser, engine_config

    parser = build_parser()
    flags = ["--data-parallel-size", "2"]
    assert engine_config(parser.parse_args(flags), 1).pipeline_parallel_size == 1
    with pytest.raises(ValueError, match=r"--data-parallel-size is not supported with pipeline"):
        engine_config(parser.parse_args([*flags, "-pp", "2"]), 1)
    config = engine_config(parser.parse_args(["--pipeline-parallel-size", "2", "-tp", "3"]), 3)
    assert (config.pipeline_parallel_size, config.world_size) == (2, 6)
    # Sleep mode and weight updates run under pipeline parallelism (tests/test_pp_rl.py).
    flags = ["-pp", "2", "--enable-weight-updates", "--enable-sleep-mode"]
    assert engine_config(parser.parse_args(flags), 1).pipeline_parallel_size == 2


def test_weight_map_skips_and_covers_by_stage(tied: Path) -> None:
    """Each stage's map resolves another stage's tensors to nothing (`held_elsewhere`), and
    a batch covers a stage when it fills that stage's parts, whatever it lacks elsewhere."""
    from rank_worker.models.weight_map import WeightMap

    ckpt = load_file(str(tied / "model.safetensors"))
    first = WeightMap(build_model(load_hf_config(tied), SINGLE, torch.float32, "meta",
                                  stage=PipelineStage(0, 2, 0, 2, 3)))  # fmt: skip
    last = WeightMap(build_model(load_hf_config(tied), SINGLE, torch.float32, "meta",
                                 stage=PipelineStage(1, 2, 2, 3, 3)))  # fmt: skip
    layer2 = "model.layers.2.mlp.up_proj.weight"
    assert first.held_elsewhere(layer2) and not last.held_elsewhere(layer2)
    assert last.held_elsewhere("model.layers.0.mlp.up_proj.weight")
    assert first.held_elsewhere("model.norm.weight") and not last.held_elsewhere(
        "model.norm.weight"
    )
    # The tied embedding: both stages hold it (the last as its head).
    embed = "model.embed_tokens.weight"
    assert not first.held_elsewhere(embed) and not last.held_elsewhere(embed)
    assert [t.part.param for t in last.resolve(embed) or []] == ["lm_head.weight"]
    # Unknown and ignored names are nobody's.
    assert not first.held_elsewhere("model.layers.9.mlp.up_proj.weight")
    assert not first.held_elsewhere("model.layers.0.self_attn.rotary_emb.inv_freq")
    stage0 = [n for n in ckpt if not n.startswith(("model.layers.2.", "model.norm."))]
    assert first.covers(stage0) and not last.covers(stage0)
    assert first.covers(ckpt) and last.covers(ckpt)
    assert not last.covers([n for n in ckpt if n != embed])  # the head's copy is missing


def test_cuda_graphs_off_under_pp() -> None:
    from rank_worker.attention.selection import get_backend
    from rank_worker.runner.cuda_graphs import disabled_reason

    pipe = PipelineInfo.build(TPInfo(0, 2), 2, 4)
    cuda = torch.device("cuda", 0)  # only named: disabled_reason reads the type
    reason = disabled_reason(cuda, False, get_backend("torch"), pipe.tp, pipe)
    assert reason is not None and "pipeline_parallel_size=2" in reason
    whole = PipelineInfo.build(SINGLE, 1, 4)
    assert "pipeline" not in (
        disabled_reason(cuda, False, get_backend("torch"), SINGLE, whole) or ""
    )
