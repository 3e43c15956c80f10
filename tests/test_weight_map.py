"""Run-time weight updates through the one name-to-shard map (`rank_worker.models.weight_map`).

The reference for an update is a fresh load: a model loaded from checkpoint A and then updated
in place with all of checkpoint B's tensors must hold exactly what a model loaded from B holds,
in the same storage (every `data_ptr` unchanged: the CPU stand-in for captured CUDA graphs
staying valid). Weight loaders need no process group, so every rank of a TP group is built in
this one process; ranks are chosen to cover vocabulary padding (643 rows over 2 ranks),
replicated KV heads (1 KV head over 2 ranks), tied heads, and experts another rank holds.
A refused batch must leave every parameter as it was, even when the bad tensor comes last.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rank_worker.models.architectures import build_model
from rank_worker.models.loader import load_weights, safetensors_files
from rank_worker.models.weight_map import WeightMap
from rank_worker.runner.model_runner import load_hf_config
from rank_worker.tp import TPInfo
from tp_engine.testing import build_random_qwen3, build_random_qwen3_moe

DENSE = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=8,
             intermediate_size=64, max_position_embeddings=64)  # fmt: skip
# Layer 0 dense, layer 1 sparse: both kinds of MLP in one model.
MOE = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
           num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64,
           mlp_only_layers=[0], max_position_embeddings=64)  # fmt: skip
EXPERTS = "model.layers.1.mlp.experts"

# (rank, size, expert_parallel)
DENSE_RANKS = [(0, 1, False), (0, 2, False), (1, 2, False)]
MOE_RANKS = [(0, 1, False), (1, 2, False), (0, 2, True), (3, 4, True)]


def _pair(build: Callable[..., Path], root: Path, **shape) -> tuple[Path, Path]:  # type: ignore[no-untyped-def]
    return build(root / "a", seed=1, **shape), build(root / "b", seed=2, **shape)


@pytest.fixture(scope="module")
def dense_untied(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _pair(build_random_qwen3, tmp_path_factory.mktemp("untied"), **DENSE)


@pytest.fixture(scope="module")
def dense_tied(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tied")
    return _pair(build_random_qwen3, root, tie_word_embeddings=True, **DENSE)


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _pair(build_random_qwen3_moe, tmp_path_factory.mktemp("moe"), **MOE)


def _model(model_dir: Path, rank: int, size: int, ep: bool, dtype=torch.float32) -> torch.nn.Module:  # type: ignore[no-untyped-def]
    model = build_model(
        load_hf_config(model_dir), TPInfo(rank, size), dtype, "cpu", enable_expert_parallel=ep
    )
    load_weights(model, model_dir)
    return model


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        out.update(load_file(str(path)))
    return out


def _stream(tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """An iterator, as a trainer sends them: the map must not need to read it twice."""
    yield from tensors.items()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Compare bit for bit, fp8 included (torch.equal has no fp8 kernel on CPU)."""
    return t.detach().contiguous().view(torch.uint8).clone()


def _state(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    return {n: (_bits(p), p.data_ptr()) for n, p in model.named_parameters()}


def _assert_holds(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        assert torch.equal(_bits(p), expected[name]), name


def _assert_unchanged(model: torch.nn.Module, before: dict[str, tuple[torch.Tensor, int]]) -> None:
    for name, p in model.named_parameters():
        assert p.data_ptr() == before[name][1], f"{name} moved to new storage"
        assert torch.equal(_bits(p), before[name][0]), f"{name} was written"


def _fused(
    tensors: dict[str, torch.Tensor], layer: int = 1, n: int = MOE["num_experts"]
) -> dict[str, torch.Tensor]:
    """transformers 5's in-memory expert layout: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    t = dict(tensors)
    experts = f"model.layers.{layer}.mlp.experts"
    t[f"{experts}.gate_up_proj"] = torch.stack(
        [torch.cat([t.pop(f"{experts}.{e}.gate_proj.weight"), t.pop(f"{experts}.{e}.up_proj.weight")])
         for e in range(n)]
    )  # fmt: skip
    t[f"{experts}.down_proj"] = torch.stack(
        [t.pop(f"{experts}.{e}.down_proj.weight") for e in range(n)]
    )
    return t


def _update_equals_fresh(a: Path, b: Path, rank: int, size: int, ep: bool, incoming) -> None:  # type: ignore[no-untyped-def]
    model = _model(a, rank, size, ep)
    before = _state(model)
    fresh = {n: _bits(p) for n, p in _model(b, rank, size, ep).named_parameters()}
    assert any(not torch.equal(before[n][0], fresh[n]) for n in fresh)  # A and B differ
    errors = WeightMap(model).update(_stream(incoming))
    assert errors == []
    _assert_holds(model, fresh)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == {
        n: ptr for n, (_, ptr) in before.items()
    }


@pytest.mark.parametrize("rank,size,ep", DENSE_RANKS)
@pytest.mark.parametrize("which", ["untied", "tied"])
def test_dense_update_equals_a_fresh_load(which, rank, size, ep, dense_untied, dense_tied):
    a, b = dense_untied if which == "untied" else dense_tied
    incoming = _tensors(b)
    if which == "tied":  # state_dict() lists the tie twice; the head is the embedding
        incoming["lm_head.weight"] = incoming["model.embed_tokens.weight"]
    _update_equals_fresh(a, b, rank, size, ep, incoming)


@pytest.mark.parametrize("rank,size,ep", MOE_RANKS)
def test_moe_update_equals_a_fresh_load(rank, size, ep, moe):
    a, b = moe
    _update_equals_fresh(a, b, rank, size, ep, _tensors(b))


@pytest.mark.parametrize("rank,size,ep", MOE_RANKS)
def test_fused_expert_tensors_are_split_into_the_experts(rank, size, ep, moe):
    a, b = moe
    _update_equals_fresh(a, b, rank, size, ep, _fused(_tensors(b)))


def test_a_subset_changes_only_its_parameters(dense_untied):
    a, b = dense_untied
    model = _model(a, 1, 2, False)
    before = _state(model)
    new = _tensors(b)
    names = ["model.layers.1.self_attn.k_proj.weight", "model.norm.weight"]
    assert WeightMap(model).update((n, new[n]) for n in names) == []
    qkv = model.model.layers[1].self_attn.qkv_proj
    changed = {"model.layers.1.self_attn.qkv_proj.weight", "model.norm.weight"}
    for name, p in model.named_parameters():
        assert p.data_ptr() == before[name][1]
        if name not in changed:
            assert torch.equal(_bits(p), before[name][0]), name
    # Only the k rows of the packed projection: this rank's one KV head (replicated at TP 2).
    k_rows = slice(qkv.q_size, qkv.q_size + qkv.kv_size)
    old = before["model.layers.1.self_attn.qkv_proj.weight"][0].view(torch.float32)
    old = old.view(qkv.weight.shape)
    torch.testing.assert_close(qkv.weight[k_rows], new[names[0]], rtol=0, atol=0)
    keep = torch.ones(qkv.weight.shape[0], dtype=torch.bool)
    keep[k_rows] = False
    assert torch.equal(qkv.weight[keep], old[keep])
    assert torch.equal(model.model.norm.weight, new["model.norm.weight"])


def test_bf16_tensors_are_cast_into_an_fp32_model(moe):
    a, b = moe
    model = _model(a, 1, 2, False)
    fresh = _model(b, 1, 2, False)
    incoming = {n: t.to(torch.bfloat16) for n, t in _tensors(b).items()}
    assert WeightMap(model).update(_stream(incoming)) == []
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert p.dtype == torch.float32, name
        # Slicing commutes with the cast, so B rounded to bf16 is what each shard must hold.
        assert torch.equal(p, q.to(torch.bfloat16).float()), name


def test_the_runner_computes_with_the_updated_weights(dense_untied):
    """Through `ModelRunner.update_weights`: the scenario's logits equal a fresh runner's on B,
    whose differ from A's."""
    from rank_worker.runner.model_runner import ModelRunner
    from rank_worker.runner_config import RunnerConfig
    from tests.tp_cases import BLOCK_SIZE, MAX_MODEL_LEN, make_scenario

    a, b = dense_untied
    config = RunnerConfig(max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, num_kv_blocks=48)
    updated, fresh, old = (ModelRunner(d, config, TPInfo(0, 1), "cpu") for d in (a, b, a))
    assert updated.update_weights(_stream(_tensors(b))) == []
    for runner in (updated, fresh, old):
        runner.init_kv_cache(48)
    differ = 0
    for plan in make_scenario(fresh.vocab_size).plans:
        want = fresh.execute(plan)
        assert torch.equal(updated.execute(plan), want), f"step {plan.step_id}"
        differ += not torch.equal(old.execute(plan), want)
    assert differ > 0


# -- refusals: named, and nothing written ---------------------------------------------------------

BAD_DENSE = [
    ("model.layers.0.mlp.extra_proj.weight", torch.zeros(2), r"no weight of that name"),
    ("model.layers.0.mlp.down_proj.weight", torch.zeros(32, 60), r"\(32, 60\).*\(32, 64\)"),
    ("model.layers.1.self_attn.q_proj.weight", torch.zeros(33, 32), r"\(33, 32\).*\(32, 32\)"),
    ("model.norm.weight", torch.ones(32, dtype=torch.int64), r"torch\.int64 is not a floating"),
    ("model.norm.weight", torch.ones(32).to(torch.float8_e4m3fn), r"not keep in fp8"),
    ("model.layers.0.self_attn.k_scale", torch.tensor([-1.0]), r"positive"),
    ("model.embed_tokens.weight", None, r"more than once"),  # B's own tensor, a second time
]


@pytest.mark.parametrize("name,bad,message", BAD_DENSE, ids=lambda x: None)
def test_a_refused_dense_batch_names_the_tensor_and_writes_nothing(
    name, bad, message, dense_untied
):
    a, b = dense_untied
    model = _model(a, 1, 2, False)
    before = _state(model)
    new = _tensors(b)
    batch = [*new.items(), (name, new[name] if bad is None else bad)]  # the bad one comes last
    errors = WeightMap(model).update(iter(batch))
    assert len(errors) == 1 and repr(name) in errors[0]
    assert re.search(message, errors[0]), errors[0]
    _assert_unchanged(model, before)


BAD_MOE = [
    (f"{EXPERTS}.gate_up_proj", torch.zeros(6, 16, 32), r"\(6, 16, 32\).*\(6, 32, 32\)"),
    (f"{EXPERTS}.down_proj", torch.zeros(6, 32, 16).to(torch.float8_e4m3fn), r"fp8"),
    (f"{EXPERTS}.7.up_proj.weight", torch.zeros(16, 32), r"no weight of that name"),
    # Expert 0 is not on rank 3 of 4: its shape is checked all the same, on every rank.
    (f"{EXPERTS}.0.up_proj.weight", torch.zeros(8, 32), r"\(8, 32\).*\(16, 32\)"),
    # A per-expert tensor beside the fused one that also holds it.
    (f"{EXPERTS}.5.gate_proj.weight", torch.zeros(16, 32), r"more than once"),
]


@pytest.mark.parametrize("name,bad,message", BAD_MOE, ids=lambda x: None)
@pytest.mark.parametrize("rank,size,ep", [(1, 2, False), (3, 4, True)])
def test_a_refused_moe_batch_names_the_tensor_and_writes_nothing(
    name, bad, message, rank, size, ep, moe
):
    a, b = moe
    model = _model(a, rank, size, ep)
    before = _state(model)
    new = _fused(_tensors(b))
    errors = WeightMap(model).update(iter([*new.items(), (name, bad)]))
    assert len(errors) == 1 and repr(name) in errors[0] and re.search(message, errors[0]), errors
    _assert_unchanged(model, before)


def test_check_reads_shapes_only(dense_untied):
    a, _ = dense_untied
    wmap = WeightMap(_model(a, 0, 2, False))
    assert wmap.check("model.layers.0.mlp.gate_proj.weight", (64, 32), torch.bfloat16) is None
    assert wmap.check("model.layers.0.self_attn.k_scale", (1,), torch.float32) is None
    error = wmap.check("model.layers.0.mlp.gate_proj.weight", (64, 31), torch.float32)
    assert (
        error is not None and "gate_proj" in error and "(64, 31)" in error and "(64, 32)" in error
    )
    assert wmap.resolve("model.rotary_emb.inv_freq") == []
    assert [t.part.shard_id for t in wmap.resolve("model.layers.0.self_attn.v_proj.weight")] == [
        "v"
    ]
    assert wmap.resolve("lm_head.weight")[0].part.param == "lm_head.weight"  # untied


# -- FP8 models ---------------------------------------------------------------------------------

# tests/fp8_cases.MOE's shape (widths of whole 128-blocks, two sparse layers of 4 experts).
FP8_RANKS = [(0, 1, False), (1, 2, False), (1, 2, True)]


@pytest.fixture(scope="module")
def fp8_moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.fp8_cases import MAX_MODEL_LEN
    from tests.fp8_cases import MOE as FP8_MOE
    from tp_engine.testing import quantize_checkpoint_fp8

    root = tmp_path_factory.mktemp("fp8")
    shape = dict(FP8_MOE, max_position_embeddings=MAX_MODEL_LEN, dtype="bfloat16")
    out = {}
    for name, seed in (("a", 1), ("b", 2)):
        out[f"{name}_bf16"] = build_random_qwen3_moe(
            root / f"{name}_bf16", **(shape | {"seed": seed})
        )
        out[name] = quantize_checkpoint_fp8(out[f"{name}_bf16"], root / name)
    return out


@pytest.mark.parametrize("rank,size,ep", FP8_RANKS)
@pytest.mark.parametrize("source", ["bf16", "fp32", "fused_bf16", "fp8_pairs"])
def test_fp8_update_equals_a_fresh_load_of_the_fp8_checkpoint(source, rank, size, ep, fp8_moe):
    """Float tensors are block-quantized as `quantize_checkpoint_fp8` makes the checkpoint, so
    the result is the fresh load of B's FP8 checkpoint bit for bit; pre-quantized weights with
    their scales are taken as they are."""
    if source == "fp8_pairs":
        incoming = _tensors(fp8_moe["b"])
    else:
        incoming = _tensors(fp8_moe["b_bf16"])
        if source == "fp32":
            incoming = {n: t.float() for n, t in incoming.items()}
        if source == "fused_bf16":
            for layer in (0, 1):
                incoming = _fused(incoming, layer, 4)
    _update_equals_fresh(fp8_moe["a"], fp8_moe["b"], rank, size, ep, incoming)


W = "model.layers.0.self_attn.o_proj.weight"
E = "model.layers.1.mlp.experts.2.down_proj.weight"  # on rank 1 of 2 under expert parallelism


def _fp8_refusals() -> list[tuple[str, Callable[[dict], list], str]]:
    def without(name: str) -> Callable[[dict], list]:
        return lambda fp8, bf16: [(n, t) for n, t in fp8.items() if n != name]

    return [
        ("weight_without_scale", without(W + "_scale_inv"), rf"'{W}'.*needs.*{W}_scale_inv"),
        ("expert_without_scale", without(E + "_scale_inv"), rf"'{E}'.*needs.*{E}_scale_inv"),
        ("scale_without_weight", without(W), rf"'{W}_scale_inv'.*needs its weight in fp8"),
        (
            "scale_beside_a_float_weight",
            lambda fp8, bf16: [(n, bf16[W] if n == W else t) for n, t in fp8.items()],
            rf"'{W}_scale_inv'.*needs its weight in fp8",
        ),
        (
            "float_weight_with_a_scale",
            lambda fp8, bf16: [(W, bf16[W]), (W + "_scale_inv", fp8[W + "_scale_inv"])],
            rf"'{W}_scale_inv'.*needs its weight in fp8",
        ),
        (
            "wrong_shape_requantized",
            lambda fp8, bf16: [*bf16.items(), (W.replace("o_proj", "q_proj"), bf16[W][:, :128])],
            r"q_proj.*\(256, 128\).*\(512, 256\)",
        ),
    ]


@pytest.mark.parametrize("case", _fp8_refusals(), ids=lambda c: c[0])
@pytest.mark.parametrize("rank,size,ep", [(1, 2, True)])
def test_fp8_batches_without_their_scales_are_refused(case, rank, size, ep, fp8_moe):
    _, make, message = case
    model = _model(fp8_moe["a"], rank, size, ep)
    before = _state(model)
    batch = make(_tensors(fp8_moe["b"]), _tensors(fp8_moe["b_bf16"]))
    errors = WeightMap(model).update(iter(batch))
    assert errors and any(re.search(message, e) for e in errors), errors
    _assert_unchanged(model, before)
