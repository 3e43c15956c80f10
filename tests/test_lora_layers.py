"""Multi-LoRA at the model-runner level: a mixed batch of three PEFT adapters and the base model
equals PEFT's float32 logits row by row, at TP = 1 (in this process), 2 and 4 (gloo ranks).

The adapters (`tests.lora_cases`) differ in rank (4, 8, 16 with a per-module 8), modules (q/v
only; all seven on one layer only; k/o/gate/down) and scaling (plain, rsLoRA, per-module
alpha), and sit in device slots out of name order. They are loaded by the LOAD_LORA control
call on every rank; every unservable adapter is refused with vLLM's message; after UNLOAD_LORA
the emptied slot computes the base model.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from rank_worker.tp import TPInfo
from tests.lora_cases import (
    BASE_CHECKPOINT,
    REFUSALS,
    build_adapters,
    build_bad_adapters,
    lora_reference,
    lora_tp_worker,
    make_lora_scenario,
    run_lora_scenario,
)
from tests.tp_cases import MAX_MODEL_LEN

# fp32 on both sides; TP reorders sums (~1e-6 on logits of magnitude ~3-10).
ATOL = 1e-4
RANKS_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import AutoConfig

    from tp_engine.checkpoints import build_random_qwen3

    root = tmp_path_factory.mktemp("lora")
    base = build_random_qwen3(
        root / "base", max_position_embeddings=MAX_MODEL_LEN, **BASE_CHECKPOINT
    )
    adapters = build_adapters(base, root)
    bad = build_bad_adapters(adapters["a"], root / "bad")
    scenario = make_lora_scenario(AutoConfig.from_pretrained(base).vocab_size)
    args = (
        str(base),
        {name: str(p) for name, p in adapters.items()},
        {name: str(p) for name, p in bad.items()},
        [plan.encode() for plan in scenario.plans],
        scenario.slots,
        scenario.unload,
    )
    return {"args": args, "bad": bad, "reference": lora_reference(base, adapters, scenario),
            "scenario": scenario}  # fmt: skip


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


# gpu_data_paths: the per-token slots through the GPU's double-buffered staging, on CPU.
@pytest.mark.parametrize("fields", [{}, {"gpu_data_paths": True}], ids=["cpu", "gpu_paths"])
def test_mixed_batch_tp1(case: dict[str, Any], fields: dict[str, Any]) -> None:
    _check(run_lora_scenario(*case["args"], TPInfo(0, 1), **fields), case)


def run_ranks(
    world_size: int, args: tuple, fields: dict[str, Any], tmp: Path
) -> list[dict[str, Any]]:
    """`run_lora_scenario(*args, tp, **fields)` on `world_size` forked gloo ranks; what each
    returned."""
    ctx = mp.start_processes(
        lora_tp_worker,
        args=(world_size, str(tmp / "store"), args, fields, str(tmp)),
        nprocs=world_size,
        join=False,
        start_method="fork",
    )
    deadline = time.monotonic() + RANKS_TIMEOUT_S
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"TP={world_size} LoRA ranks did not finish in {RANKS_TIMEOUT_S}s")
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


# TP = 4 replicates the 2 KV heads: k/v's B rows are replicated as the base weights are.
@pytest.mark.parametrize("world_size", [2, 4])
def test_mixed_batch_tp(case: dict[str, Any], tmp_path: Path, world_size: int) -> None:
    first, *others = run_ranks(world_size, case["args"], {}, tmp_path)
    _check(first, case)
    for result in others:
        assert all(x is None for x in result["logits"])
        assert result["refusals"] == first["refusals"]


def test_mixed_batch_triton_tp1(case: dict[str, Any]) -> None:
    # The Triton attention and layer kernels, and with them the LoRA shrink and expand
    # kernels (interpreted on CPU).
    result = run_lora_scenario(*case["args"], TPInfo(0, 1), attention_backend="triton")
    _check(result, case)
