"""PEFT adapters for the LoRA tests, made here with PEFT itself, and PEFT's float32 logits as
the reference (`transformers` + `peft`, nothing downloaded).

`ADAPTERS` are three adapters with non-zero B (`init_lora_weights=False`: PEFT's default B is
zero, which would make every adapter the base model and test nothing), of different ranks and
modules, one rsLoRA, one with per-module rank and alpha, one on some layers only:

    name  r   modules                          other
    a     4   q, v                             (attention only: also fits Qwen3-MoE)
    b     8   all seven                        use_rslora, layers_to_transform=[1]
    c     16  k, o, gate, down                 rank_pattern down 8, alpha_pattern o 4

`build_bad_adapters` makes one adapter per refusal, each refused with vLLM's message (`REFUSALS`).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shm_ipc.step_plan import StepPlan

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> peft.LoraConfig arguments (besides init_lora_weights=False, lora_dropout=0).
ADAPTERS: dict[str, dict[str, Any]] = {
    "a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "b": dict(r=8, lora_alpha=16, target_modules=ALL_MODULES, use_rslora=True,
              layers_to_transform=[1]),
    "c": dict(r=16, lora_alpha=32, target_modules=["k_proj", "o_proj", "gate_proj", "down_proj"],
              rank_pattern={"down_proj": 8}, alpha_pattern={"o_proj": 4}),
}  # fmt: skip
# The engine limit the adapters above fit under (c's rank is 16).
MAX_LORA_RANK = 16
# Seeds of each adapter's random A and B.
_SEEDS = {"a": 11, "b": 12, "c": 13}

# Bad adapter name -> the message its refusal carries (`{path}` is its directory).
REFUSALS: dict[str, str] = {
    "dora": "vLLM does not yet support DoRA.",
    "modules_to_save": "vLLM only supports modules_to_save being None.",
    "bias": "Adapter bias is not supported.",
    "lora_bias": "Adapter bias is not supported.",
    "bias_key": "Adapter bias is not supported.",  # a bias tensor, whatever the config says
    "rank": "LoRA rank 32 is greater than max_lora_rank 16.",
    "lm_head": (
        "While loading {path}, expected target modules in ['q_proj', 'k_proj', 'v_proj', "
        "'o_proj', 'gate_proj', 'up_proj', 'down_proj'] but received ['lm_head']. Please "
        "verify that the loaded LoRA module is correct"
    ),
    "router_experts": (
        "While loading {path}, expected target modules in ['q_proj', 'k_proj', 'v_proj', "
        "'o_proj', 'gate_proj', 'up_proj', 'down_proj'] but received "
        "['model.layers.0.mlp.experts.3.down_proj', 'model.layers.0.mlp.gate']. Please "
        "verify that the loaded LoRA module is correct"
    ),
    "missing": "No adapter found for {path}",
}


def load_base(base_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def build_adapter(base_dir: Path, out_dir: Path, seed: int, **lora_kwargs: Any) -> Path:
    """A PEFT adapter of the checkpoint at `base_dir`, random A and B from `seed`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(init_lora_weights=False, lora_dropout=0.0, **lora_kwargs)
    model = get_peft_model(load_base(base_dir), config)  # adapter "default": saved at out_dir
    model.save_pretrained(out_dir)
    return out_dir


def build_adapters(base_dir: Path, root: Path) -> dict[str, Path]:
    return {
        name: build_adapter(base_dir, root / name, _SEEDS[name], **kwargs)
        for name, kwargs in ADAPTERS.items()
    }


def build_bad_adapters(good: Path, root: Path) -> dict[str, Path]:
    """One adapter per `REFUSALS` entry, each a copy of the adapter `good` with one flaw."""
    from safetensors.torch import load_file, save_file

    out: dict[str, Path] = {}

    def variant(name: str, config: dict[str, Any], extra: dict[str, torch.Tensor]) -> None:
        path = root / name
        shutil.copytree(good, path)
        cfg = json.loads((path / "adapter_config.json").read_text())
        cfg.update(config)
        (path / "adapter_config.json").write_text(json.dumps(cfg))
        if extra:
            weights = load_file(path / "adapter_model.safetensors")
            save_file(
                {**weights, **{k: t.contiguous() for k, t in extra.items()}},
                path / "adapter_model.safetensors",
            )
        out[name] = path

    a = torch.zeros(4, 8)
    variant("dora", {"use_dora": True}, {})
    variant("modules_to_save", {"modules_to_save": ["lm_head"]}, {})
    variant("bias", {"bias": "lora_only"}, {})
    variant("lora_bias", {"lora_bias": True}, {})
    bias = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias"
    variant("bias_key", {}, {bias: torch.zeros(64)})
    variant("rank", {"r": 32}, {})
    variant("lm_head", {}, {"base_model.model.lm_head.lora_A.weight": a})
    prefix = "base_model.model.model.layers.0.mlp."
    variant(
        "router_experts",
        {},
        {f"{prefix}gate.lora_A.weight": a, f"{prefix}experts.3.down_proj.lora_B.weight": a.T},
    )
    out["missing"] = root / "missing"  # never written
    return out


def peft_logits(base_dir: Path, adapter_dir: Path | None, token_ids: list[int]) -> torch.Tensor:
    """`[len, vocab]` float32 logits of PEFT's model (the base model for None) over a prompt."""
    from peft import PeftModel

    model = load_base(base_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


# -- a mixed batch at the model-runner level --------------------------------------------------

# The base checkpoint (as tp_cases' "tied_kv2_oddvocab": 2 KV heads, replicated at TP = 4).
BASE_CHECKPOINT: dict[str, Any] = dict(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, tie_word_embeddings=True, seed=1,
)  # fmt: skip
# Adapter -> device slot (not in name order, so a slot mix-up shows).
SLOTS = {"a": 2, "b": 0, "c": 1}
MAX_LORAS = 3
# Sequence -> (adapter or None, prompt length, row, block ids).
_SEQS: dict[str, tuple[str | None, int, int, list[int]]] = {
    "base": (None, 9, 0, [5, 6, 7]),
    "a": ("a", 6, 1, [1, 2]),
    "b": ("b", 11, 2, [8, 9, 10]),
    "c": ("c", 5, 3, [3, 4]),
    # Run after adapter a is unloaded from its slot: a's prompt in a's slot is the base model.
    "a_unloaded": ("a", 6, 4, [11, 12]),
}
# A mixed batch: every sequence prefills its prompt but one token, then decodes the last one
# (in another order); then, after adapter a is unloaded, "a_unloaded".
_STEPS: list[list[tuple[str, int, str]]] = [
    [("base", 8, "all"), ("a", 5, "all"), ("b", 10, "all"), ("c", 4, "all")],
    [("c", 1, "all"), ("base", 1, "all"), ("b", 1, "all"), ("a", 1, "all")],
    [("a_unloaded", 6, "all")],
]


@dataclass
class LoraScenario:
    sequences: dict[str, np.ndarray]
    adapters: dict[str, str | None]  # sequence -> the adapter of its reference (None: base)
    slots: dict[str, int]  # adapter -> device slot
    plans: list[StepPlan]
    unload: str | None  # the adapter unloaded before the last plan, if any
    expected: list[list[tuple[str, int]]]  # per plan: (sequence, position) of each logits row


def make_lora_scenario(
    vocab_size: int,
    slots: dict[str, int] = SLOTS,
    sequences: dict[str, tuple[str | None, int, int, list[int]]] = _SEQS,
    steps: list[list[tuple[str, int, str]]] = _STEPS,
    seed: int = 7,
) -> LoraScenario:
    """Plans of `steps` over `sequences` (`tests.tp_cases` plans) with each sequence's adapter
    slot; a sequence named `<adapter>_unloaded` repeats that adapter's prompt after it is
    unloaded, so its reference is the base model."""
    from tests.tp_cases import _plan, _Seq

    rng = np.random.default_rng(seed)
    tokens = {name: rng.integers(0, vocab_size, n) for name, (_, n, _, _) in sequences.items()}
    adapters = {name: spec[0] for name, spec in sequences.items()}
    unload = None
    for name in sequences:
        if name.endswith("_unloaded"):
            unload = name.removesuffix("_unloaded")
            tokens[name] = tokens[unload]
            adapters[name] = None
    seqs = {
        name: _Seq(tokens[name], blocks, row=row) for name, (_, _, row, blocks) in sequences.items()
    }

    def with_slots(plan: StepPlan, names: list[str]) -> StepPlan:
        ids = [slots[a] if (a := sequences[n][0]) else -1 for n in names]
        return plan.with_sections(adapter_slots=np.array(ids, dtype=np.int32))

    plans, expected = [], []
    for step_id, work in enumerate(steps):
        plan, rows = _plan(step_id, seqs, work)
        plans.append(with_slots(plan, [name for name, _, _ in work]))
        expected.append(rows)
    return LoraScenario(tokens, adapters, dict(slots), plans, unload, expected)


def lora_reference(
    base_dir: Path, adapter_dirs: dict[str, Path], scenario: LoraScenario
) -> list[torch.Tensor]:
    """PEFT's logits of every expected row (`scenario.expected`)."""
    full = {}
    for name, tokens in scenario.sequences.items():
        adapter = scenario.adapters[name]
        path = None if adapter is None else adapter_dirs[adapter]
        full[name] = peft_logits(base_dir, path, tokens.tolist())
    return [torch.stack([full[name][p] for name, p in rows]) for rows in scenario.expected]


def lora_runner(base_dir: str, tp: Any, device: str = "cpu", **runner_fields: Any) -> Any:
    """A ModelRunner with LoRA (`MAX_LORAS` slots, rank up to `MAX_LORA_RANK`, 4 adapters
    in host memory unless `runner_fields` say otherwise), its KV cache allocated."""
    from rank_worker.runner.model_runner import ModelRunner
    from rank_worker.runner_config import RunnerConfig
    from tests.tp_cases import BLOCK_SIZE, MAX_MODEL_LEN, NUM_KV_BLOCKS

    fields = dict(max_loras=MAX_LORAS, max_lora_rank=MAX_LORA_RANK, max_cpu_loras=4)
    fields.update(runner_fields)
    config = RunnerConfig(
        max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS,
        enable_lora=True, **fields,
    )  # fmt: skip
    runner = ModelRunner(base_dir, config, tp, device)
    runner.init_kv_cache(runner.determine_num_kv_blocks())
    return runner


def lora_call(runner: Any, tp: Any, op: str, **args: Any) -> Any:
    """One control call (`ControlOp[op]`) on this rank, both phases: the ranks' real path."""
    import rank_worker.control.lora_ops  # noqa: F401  (registers the LoRA ops)
    from rank_worker.control.protocol import ControlOp, RankControl
    from shm_ipc import ControlCall

    return RankControl(runner, tp).run(ControlCall(0, int(ControlOp[op]), args))


def run_lora_scenario(
    base_dir: str,
    adapter_dirs: dict[str, str],
    bad_dirs: dict[str, str],
    encoded: list[bytes],
    slots: dict[str, int],
    unload: str | None,
    tp: Any,
    **runner_fields: Any,
) -> dict[str, Any]:
    """On this rank: a runner with LoRA (`lora_runner`), the adapters loaded by control call
    into their `slots`, every bad adapter refused, the plans run (the last after unloading
    adapter `unload`, uid and all, if given). Returns the logits per plan (None off rank 0),
    the refusal messages, and the slots and host LRU left."""
    from tp_engine.features.lora.control import lora_refusal

    runner = lora_runner(base_dir, tp, **runner_fields)
    loads = {
        name: lora_call(runner, tp, "LOAD_LORA", slot=slots[name], lora_uid=name, path=path).ok
        for name, path in adapter_dirs.items()
    }
    refusals = {
        name: lora_refusal(
            lora_call(runner, tp, "LOAD_LORA", slot=0, lora_uid=f"bad-{name}", path=path)
        )
        for name, path in bad_dirs.items()
    }
    plans = [StepPlan.decode(data) for data in encoded]
    logits = [runner.execute(plan) for plan in (plans[:-1] if unload else plans)]
    unloaded = None
    if unload is not None:
        unloaded = lora_call(runner, tp, "UNLOAD_LORA", slot=slots[unload], lora_uid=unload).ok
        logits.append(runner.execute(plans[-1]))
    return {
        "loads": loads,
        "refusals": refusals,
        "logits": logits,
        "unloaded": unloaded,
        "host_uids": list(runner.lora.host),
        "slot_uids": list(runner.lora.slot_uids),
    }


def lora_tp_worker(
    rank: int, world_size: int, init_file: str, args: tuple, fields: dict, out_dir: str
) -> None:
    """Entry point of one spawned rank: `run_lora_scenario` in a gloo group, saved to
    `out_dir/rank<r>.pt` (or its traceback)."""
    import traceback

    from rank_worker.tp import destroy_process_group, init_process_group

    torch.set_num_threads(1)
    out = Path(out_dir) / f"rank{rank}.pt"
    try:
        tp = init_process_group(
            "gloo", rank=rank, world_size=world_size, init_method=f"file://{init_file}",
            timeout_s=60,
        )  # fmt: skip
        torch.save(run_lora_scenario(*args, tp, **fields), out)
        destroy_process_group()
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        raise


RANKS_TIMEOUT_S = 240


def run_lora_ranks(
    world_size: int, args: tuple, fields: dict[str, Any], tmp: Path
) -> list[dict[str, Any]]:
    """`run_lora_scenario(*args, tp, **fields)` on `world_size` gloo ranks (forked, or spawned
    where this process holds a process group a fork would inherit); what each returned."""
    import time

    import pytest
    import torch.distributed as dist
    import torch.multiprocessing as mp

    ctx = mp.start_processes(
        lora_tp_worker,
        args=(world_size, str(tmp / "store"), args, fields, str(tmp)),
        nprocs=world_size,
        join=False,
        start_method="spawn" if dist.is_available() and dist.is_initialized() else "fork",
    )
    deadline = time.monotonic() + RANKS_TIMEOUT_S
    while not ctx.join(timeout=1.0):  # raises, with the child's traceback, if a rank fails
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"TP={world_size} LoRA ranks did not finish in {RANKS_TIMEOUT_S}s")
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
