"""Multi-LoRA at the model-runner level: a mixed batch of three PEFT adapters and the base model
equals PEFT's float32 logits row by row, at TP = 1 (in this process), 2 and 4 (gloo ranks).

The adapters (`tests.lora_cases`) differ in rank (4, 8, 16 with a per-module 8), modules (q/v
only; all seven on one layer only; k/o/gate/down) and scaling (plain, rsLoRA, per-module
alpha), and sit in device slots out of name order. They are loaded by the LOAD_LORA control
call on every rank; every unservable adapter is refused with vLLM's message; after UNLOAD_LORA
the emptied slot computes the base model. The same batch runs through each LoRA path: the CPU
path (by slot), the graph-safe torch path (`gpu_data_paths`), the Triton kernels (grouped for
the prefill, per token for the decode), and the decode graph runner's padded buffers.

Also: the engine limits' messages; the host LRU evicting and reloading from disk; refused
slots and arguments changing nothing; LoRA off refused; the warm-up compiling every LoRA
kernel; on a GPU, decode graphs replaying adapters loaded after capture, and the graphs
without LoRA for a step without adapters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rank_worker.tp import TPInfo
from tests.lora_cases import (
    BASE_CHECKPOINT,
    MAX_LORAS,
    REFUSALS,
    SLOTS,
    build_adapters,
    build_bad_adapters,
    lora_call,
    lora_reference,
    lora_runner,
    make_lora_scenario,
    run_lora_ranks,
    run_lora_scenario,
)
from tests.tp_cases import MAX_MODEL_LEN

# fp32 on both sides; TP reorders sums (~1e-6 on logits of magnitude ~3-10).
ATOL = 1e-4


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import AutoConfig

    from tp_engine.testing import build_random_qwen3

    root = tmp_path_factory.mktemp("lora")
    base = build_random_qwen3(
        root / "base", max_position_embeddings=MAX_MODEL_LEN, **BASE_CHECKPOINT
    )
    adapters = build_adapters(base, root)
    bad = build_bad_adapters(adapters["a"], root / "bad")
    vocab = AutoConfig.from_pretrained(base).vocab_size
    scenario = make_lora_scenario(vocab)
    args = (
        str(base),
        {name: str(p) for name, p in adapters.items()},
        {name: str(p) for name, p in bad.items()},
        [plan.encode() for plan in scenario.plans],
        scenario.slots,
        scenario.unload,
    )
    return {"args": args, "bad": bad, "reference": lora_reference(base, adapters, scenario),
            "scenario": scenario, "vocab": vocab}  # fmt: skip


def _check(result: dict[str, Any], case: dict[str, Any]) -> None:
    assert result["loads"] == {"a": True, "b": True, "c": True}
    expected = {name: REFUSALS[name].format(path=path) for name, path in case["bad"].items()}
    assert result["refusals"] == expected
    assert result["unloaded"]
    # a's slot is empty and its host copy gone; the refused adapters were never kept.
    assert result["slot_uids"] == ["b", "c", None]
    assert sorted(result["host_uids"]) == ["b", "c"]
    rows = case["scenario"].expected
    for step, (logits, ref) in enumerate(zip(result["logits"], case["reference"], strict=True)):
        assert logits is not None and logits.shape == ref.shape
        err = (logits - ref).abs().max().item()
        assert err <= ATOL, f"step {step} rows {rows[step]}: max |diff| {err:.2e}"


# gpu_data_paths: the per-token slots through the GPU's double-buffered staging, and the LoRA
# terms through the graph-safe torch path (masks over every slot), on CPU.
@pytest.mark.parametrize("fields", [{}, {"gpu_data_paths": True}], ids=["cpu", "gpu_paths"])
def test_mixed_batch_tp1(case: dict[str, Any], fields: dict[str, Any]) -> None:
    _check(run_lora_scenario(*case["args"], TPInfo(0, 1), **fields), case)


# TP = 4 replicates the 2 KV heads: k/v's B rows are replicated as the base weights are.
@pytest.mark.parametrize("world_size", [2, 4])
def test_mixed_batch_tp(case: dict[str, Any], tmp_path: Path, world_size: int) -> None:
    first, *others = run_lora_ranks(world_size, case["args"], {}, tmp_path)
    _check(first, case)
    for result in others:
        assert all(x is None for x in result["logits"])
        assert result["refusals"] == first["refusals"]


def test_mixed_batch_triton_tp1(case: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # The Triton attention and layer kernels, and with them the LoRA kernels (interpreted on
    # CPU): grouped by slot for the 27-token prefill, per token for the 4-token decode.
    import rank_worker.lora.layers as lora_layers

    monkeypatch.setattr(lora_layers, "GROUPED_MIN_TOKENS", 16)
    result = run_lora_scenario(*case["args"], TPInfo(0, 1), attention_backend="triton")
    _check(result, case)


def test_kernel_warmup_launches_grouped_lora_kernels(case: dict[str, Any]) -> None:
    # Every binary is compiled before serving: with LoRA the warm-up has a step long enough
    # for the grouped kernels (they compile at their first launch, whatever it computes).
    import rank_worker.lora.layers as lora_layers
    from rank_worker.runner.model_runner import ModelRunner
    from rank_worker.runner_config import RunnerConfig

    config = RunnerConfig(
        max_model_len=64, block_size=4, attention_backend="triton", enable_lora=True
    )
    runner = ModelRunner(case["args"][0], config, TPInfo(0, 1), "cpu")
    sizes = [plan.num_tokens for plan in runner._kernel_warmup_plans()]
    assert max(sizes) >= lora_layers.GROUPED_MIN_TOKENS, sizes


def test_limits_refused_with_vllm_messages() -> None:
    from rank_worker.runner_config import RunnerConfig

    def config(**fields: Any) -> RunnerConfig:
        return RunnerConfig(max_model_len=64, block_size=4, enable_lora=True, **fields)

    with pytest.raises(ValueError, match=r"^max_cpu_loras \(1\) must be >= max_loras \(2\)$"):
        config(max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match=r"^max_lora_rank \(12\) must be one of \[1, 8, 16,"):
        config(max_lora_rank=12)
    with pytest.raises(ValueError, match=r"^max_loras \(0\) must be >= 1$"):
        config(max_loras=0)
    assert config(max_loras=3).resolved_max_cpu_loras == 3
    with pytest.raises(ValueError, match=r"^lora_dtype must be one of \['auto', 'float16', "):
        config(lora_dtype="fp16")


def test_lora_dtype_sets_the_slot_stacks(case: dict[str, Any]) -> None:
    """`lora_dtype` bfloat16 on a float32 model: bfloat16 stacks whose terms still give PEFT's
    logits within bfloat16's rounding of the adapter weights."""
    tp = TPInfo(0, 1)
    runner = lora_runner(case["args"][0], tp, lora_dtype="bfloat16")
    assert {t.dtype for t in runner.lora.device_tensors()} == {torch.bfloat16}
    for name, path in case["args"][1].items():
        assert lora_call(runner, tp, "LOAD_LORA", slot=SLOTS[name], lora_uid=name, path=path).ok
    plan, ref = case["scenario"].plans[0], case["reference"][0]
    base = runner.execute(
        plan.with_sections(adapter_slots=np.full_like(plan.section("adapter_slots"), -1))
    )
    logits = runner.execute(plan)
    err, effect = ((logits - ref).abs().max().item(), (base - ref).abs().max().item())
    assert ATOL < err < effect / 10, (err, effect)  # rounded, but the adapters' terms


def test_unreadable_adapter_is_a_refusal(tmp_path: Path) -> None:
    """A truncated weights file, a config without `r` or one that is no JSON object is an
    adapter refused with a ValueError naming its path (the server's 400), not another
    exception (a 500, or a raw error out of `LLM.generate`)."""
    from safetensors.torch import save_file

    from rank_worker.lora.peft_adapter import read_adapter_config

    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    bad = {
        "truncated": ('{"r": 4}', None),
        "no_rank": ('{"lora_alpha": 8}', {key.format("A"): torch.zeros(4, 8)}),
        "not_an_object": ("[4]", {key.format("A"): torch.zeros(4, 8)}),
    }
    for name, (config, weights) in bad.items():
        path = tmp_path / name
        path.mkdir()
        (path / "adapter_config.json").write_text(config)
        if weights is None:
            (path / "adapter_model.safetensors").write_bytes(b"{")
        else:
            save_file(weights, path / "adapter_model.safetensors")
        with pytest.raises(ValueError, match=f"^Invalid PEFT adapter at {path}: ") as err:
            read_adapter_config(path, 16)
        assert type(err.value) is ValueError, name


def test_host_lru_evicts_and_reloads_from_disk(case: dict[str, Any]) -> None:
    """One slot and one host copy: loading b evicts a's host copy; a, loaded again, is read
    from disk and computes what PEFT does. Bad slots and arguments are refused."""
    from tp_engine.features.lora.control import lora_refusal

    base, adapters = case["args"][0], case["args"][1]
    scenario = make_lora_scenario(
        case["vocab"], {"a": 0}, {"a": ("a", 6, 0, [1, 2])}, [[("a", 6, "all")]]
    )
    tp = TPInfo(0, 1)
    runner = lora_runner(base, tp, max_loras=1, max_cpu_loras=1)

    def load(name: str) -> Any:
        return lora_call(runner, tp, "LOAD_LORA", slot=0, lora_uid=name, path=adapters[name])

    assert load("a").ok and list(runner.lora.host) == ["a"]
    first = runner.execute(scenario.plans[0])
    assert load("b").ok and list(runner.lora.host) == ["b"]
    assert load("a").ok and list(runner.lora.host) == ["a"]
    again = runner.execute(scenario.plans[0])
    assert torch.equal(first, again)
    ref = lora_reference(Path(base), {"a": Path(adapters["a"])}, scenario)[0]
    assert (again - ref).abs().max().item() <= ATOL
    refused = {
        "slot 1": (
            lora_call(runner, tp, "LOAD_LORA", slot=1, lora_uid="x", path=adapters["a"]),
            "slot must be an int in [0, 1), got 1",
        ),
        "unload slot -1": (
            lora_call(runner, tp, "UNLOAD_LORA", slot=-1),
            "slot must be an int in [0, 1), got -1",
        ),
        "uid": (
            lora_call(runner, tp, "LOAD_LORA", slot=0, lora_uid=1.5, path=adapters["a"]),
            "lora_uid must be an int or a str, got 1.5",
        ),
    }
    for what, (result, message) in refused.items():
        assert not result.ok and lora_refusal(result) == message, what
    assert runner.lora.slot_uids == ["a"]  # nothing refused changed the slot


def test_slot_stacks_sleep_and_wake_with_the_weights(case: dict[str, Any]) -> None:
    """Sleep releases the slot stacks with the weights and brings them back exactly at either
    level (the adapter stays loaded); while they sleep a load or unload is refused."""
    from rank_worker.runner.device_sleep import SleepTag
    from tp_engine.features.lora.control import lora_refusal

    base, adapters = case["args"][0], case["args"][1]
    scenario = make_lora_scenario(
        case["vocab"], {"a": 0}, {"a": ("a", 6, 0, [1, 2])}, [[("a", 6, "all")]]
    )
    tp = TPInfo(0, 1)
    runner = lora_runner(base, tp, max_loras=1)
    assert lora_call(runner, tp, "LOAD_LORA", slot=0, lora_uid="a", path=adapters["a"]).ok
    stacks = runner.lora.device_tensors()
    before = [t.clone() for t in stacks]
    first = runner.execute(scenario.plans[0])
    for level in (1, 2):
        runner.device_sleep.sleep(level)
        assert all(t.untyped_storage().nbytes() == 0 for t in stacks), level
        for op, args in (
            ("LOAD_LORA", {"lora_uid": "b", "path": adapters["b"]}),
            ("UNLOAD_LORA", {}),
        ):
            result = lora_call(runner, tp, op, slot=0, **args)
            assert not result.ok and "the weights are asleep" in lora_refusal(result), (op, level)
        runner.device_sleep.wake_up(list(SleepTag))
        assert all(torch.equal(a, b) for a, b in zip(before, stacks, strict=True)), level
        assert runner.lora.slot_uids == ["a"]
        if level == 1:  # the weights came back too (level 2 discards them until a load)
            assert torch.equal(runner.execute(scenario.plans[0]), first)


def test_lora_not_enabled_is_refused(case: dict[str, Any]) -> None:
    from rank_worker.runner.model_runner import ModelRunner
    from rank_worker.runner_config import RunnerConfig
    from tp_engine.features.lora.control import lora_refusal

    tp = TPInfo(0, 1)
    runner = ModelRunner(case["args"][0], RunnerConfig(max_model_len=64, block_size=4), tp, "cpu")
    result = lora_call(runner, tp, "UNLOAD_LORA", slot=0)
    assert lora_refusal(result) == "LoRA is not enabled (enable_lora)"


def test_padded_decode_buffers_run_adapters(case: dict[str, Any]) -> None:
    """The decode graph runner's path on CPU (not captured: it runs the padded static buffers
    eagerly, with the GPU's data paths): the mixed decode of 4 sequences padded to 8 rows
    equals PEFT, and the padding rows' slots are -1 (the base model)."""
    from rank_worker.runner.cuda_graphs import DecodeGraphRunner
    from tests.tp_cases import BLOCK_SIZE, MAX_MODEL_LEN

    base, adapters = case["args"][0], case["args"][1]
    tp = TPInfo(0, 1)
    runner = lora_runner(base, tp, gpu_data_paths=True)
    runner.graph_runner = DecodeGraphRunner(
        runner.model, runner.kv_caches, max_num_seqs=8, max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE, device=runner.device,
    )  # fmt: skip
    runner.graph_runner.ladders[1] = [8]  # 4 sequences run in 8
    for name, path in adapters.items():
        assert lora_call(runner, tp, "LOAD_LORA", slot=SLOTS[name], lora_uid=name, path=path).ok
    prefill, decode = case["scenario"].plans[:2]
    assert runner.graph_runner.can_run(decode)
    for step, plan in enumerate((prefill, decode)):
        logits = runner.execute(plan)
        assert (logits - case["reference"][step]).abs().max().item() <= ATOL, step
    assert runner.graph_runner.num_replays == 0  # the padded eager path, not a graph
    # The prefill's adapter tokens (a's at 8..12, ...) are gone past the decode's 4 rows.
    assert runner.lora.batch.token_slots[4:].eq(-1).all()


def test_slot_past_the_stacks_is_refused(case: dict[str, Any]) -> None:
    """A plan naming a slot the rank does not have fails its step on the rank, before any
    input is written, instead of running the base model (masked path) or reading past the
    slot stacks (kernels)."""
    tp = TPInfo(0, 1)
    runner = lora_runner(case["args"][0], tp, gpu_data_paths=True)
    prefill = case["scenario"].plans[0]
    slots = prefill.section("adapter_slots").copy()
    slots[slots == slots.max()] = MAX_LORAS
    with pytest.raises(
        ValueError, match=f"adapter slot {MAX_LORAS}, but this rank has {MAX_LORAS} LoRA"
    ):
        runner.execute(prefill.with_sections(adapter_slots=slots))


@pytest.mark.gpu
def test_decode_graph_replays_adapters_gpu(case: dict[str, Any]) -> None:
    """On a GPU: adapters loaded after the decode graphs were captured (copied into the slot
    stacks in place), a mixed prefill run eagerly and the mixed decode replayed from a graph
    whose LoRA kernels read the fixed slot buffer, both equal to PEFT."""
    base, adapters = case["args"][0], case["args"][1]
    tp = TPInfo(0, 1)
    runner = lora_runner(base, tp, device="cuda")
    for name, path in adapters.items():
        assert lora_call(runner, tp, "LOAD_LORA", slot=SLOTS[name], lora_uid=name, path=path).ok
    prefill, decode = case["scenario"].plans[:2]
    graphs = runner.graph_runner
    assert graphs is not None and graphs.can_run(decode)
    assert sorted(graphs.base_graphs) == sorted(graphs.graphs)  # with and without LoRA
    for step, plan in enumerate((prefill, decode)):
        logits = runner.execute(plan).cpu()
        # fp32, but the attention kernels' dots may run in TF32 on the GPU (~1e-3 relative).
        assert (logits - case["reference"][step]).abs().max().item() <= 5e-2, step
    assert (graphs.num_replays, graphs.num_base_replays) == (1, 0)
    # The decode again with every sequence on the base model: the graph without LoRA. Row 1
    # is the base sequence, whose whole history is the base model's.
    base_only = decode.with_sections(adapter_slots=np.full(4, -1, dtype=np.int32))
    logits = runner.execute(base_only).cpu()
    assert (graphs.num_replays, graphs.num_base_replays) == (2, 1)
    assert (logits[1] - case["reference"][1][1]).abs().max().item() <= 5e-2
