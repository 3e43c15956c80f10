"""Shared by the model tests: tiny checkpoints, hand-built step plans, the HF reference, and the
entry point of the tensor-parallel ranks that test_model_tp.py starts.

The plans exercise every shape of the attention path with a block size of 4: full prefills, a
prefill split in two chunks, a prefill whose prefix lives in another sequence's blocks (prefix
cache), decodes, batches mixing all of these over non-contiguous block ids, and a step that
needs no logits at all. Every step asks for the logits of the rows it computes, and the test
compares each row with Hugging Face's logits at the same position of the full sequence.

Ranks are started once per TP size and run every case of every checkpoint in one process
group: starting processes is the slow part on a small machine.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shm_ipc.step_plan import Command, StepPlan

BLOCK_SIZE = 4
NUM_KV_BLOCKS = 48
MAX_MODEL_LEN = 64

# name -> build_random_qwen3 arguments. Chosen to cover: tied and untied heads, a vocabulary
# that TP = 2 and 4 do not divide (643, the tokenizer size), fewer KV heads than ranks (2 KV heads
# at TP=4, 1 at TP=2 and 4), several KV heads per rank (4 at TP=2), sharded safetensors.
CHECKPOINTS: dict[str, dict[str, Any]] = {
    "tied_kv2_oddvocab": dict(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, tie_word_embeddings=True, seed=1,
    ),
    "untied_kv1_sharded": dict(
        hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=8,
        intermediate_size=64, tie_word_embeddings=False, vocab_size=648,
        max_shard_bytes=20_000, seed=2,
    ),
    "untied_kv4": dict(
        hidden_size=32, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8,
        intermediate_size=96, tie_word_embeddings=False, seed=3,
    ),
}  # fmt: skip


def build_checkpoints(root: Path) -> dict[str, Path]:
    from tp_engine.testing import build_random_qwen3

    return {
        name: build_random_qwen3(root / name, max_position_embeddings=MAX_MODEL_LEN, **kwargs)
        for name, kwargs in CHECKPOINTS.items()
    }


# Rows of the padded checkpoint's embedding and LM head: more than its tokenizer's 643 tokens.
PADDED_VOCAB = 704


def build_padded_checkpoint(out_dir: Path) -> Path:
    """A checkpoint whose config vocabulary (PADDED_VOCAB) is larger than its tokenizer, as
    published Qwen3 checkpoints are (151936 rows, 151669 tokens), and whose greedy generations
    use the padding ids: with n tokens in the tokenizer, the LM head row of padding id `n + j`
    is 1.1 times the row of token `7j mod n`, so it wins wherever that token would (and a little
    more often). Generations then mix known and unknown ids."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from tp_engine.testing import build_random_qwen3

    path = build_random_qwen3(
        out_dir, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=PADDED_VOCAB, max_position_embeddings=512, seed=5,
    )  # fmt: skip
    weights_file = path / "model.safetensors"
    weights = load_file(weights_file)
    head = weights["lm_head.weight"]  # [PADDED_VOCAB, hidden]
    num_known = len(AutoTokenizer.from_pretrained(path))
    for j, pad_id in enumerate(range(num_known, PADDED_VOCAB)):
        head[pad_id] = 1.1 * head[7 * j % num_known]
    save_file(weights, weights_file, metadata={"format": "pt"})
    return path


# -- plans ------------------------------------------------------------------------------------


@dataclass
class _Seq:
    tokens: np.ndarray  # [n] every token the sequence will ever hold
    blocks: list[int]  # physical block ids, logical order
    num_computed: int = 0  # tokens whose K/V are in the cache
    row: int = 0  # its row of the block tables
    table_sent: bool = False  # whether a plan has given the ranks its blocks yet


@dataclass
class Scenario:
    """Sequences and the plans that compute them; `expected[s]` lists, for each logits row of
    plan s, (sequence name, position)."""

    sequences: dict[str, np.ndarray] = field(default_factory=dict)
    plans: list[StepPlan] = field(default_factory=list)
    expected: list[list[tuple[str, int]]] = field(default_factory=list)


def _plan(
    step_id: int, seqs: dict[str, _Seq], work: list[tuple[str, int, str]]
) -> tuple[StepPlan, list[tuple[str, int]]]:
    """One step: for each (sequence, new tokens, logits "all" | "last" | "none"). A sequence's
    first step also sends its whole block list, as an edit of its row."""
    ids, qsl, lens, rows, logits_rows, expected = [], [0], [], [], [], []
    edit_rows, edit_blocks = [], []
    for name, n, logits in work:
        s = seqs[name]
        p = np.arange(s.num_computed, s.num_computed + n)
        start = qsl[-1]
        ids.append(s.tokens[p])
        qsl.append(start + n)
        lens.append(s.num_computed + n)
        rows.append(s.row)
        if not s.table_sent:
            edit_rows.append(s.row)
            edit_blocks.append(s.blocks)
            s.table_sent = True
        chosen = {"all": range(n), "last": range(n - 1, n), "none": range(0)}[logits]
        logits_rows += [start + j for j in chosen]
        expected += [(name, int(p[j])) for j in chosen]
        s.num_computed += n

    def i32(parts: list[Any]) -> np.ndarray:
        return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)

    offsets = np.concatenate([[0], np.cumsum([len(b) for b in edit_blocks])]).astype(np.int32)
    plan = StepPlan(
        step_id=step_id,
        command=Command.RUN,
        input_ids=i32(ids),
        query_start_loc=np.array(qsl, dtype=np.int32),
        seq_lens=np.array(lens, dtype=np.int32),
        rows=np.array(rows, dtype=np.int32),
        logits_indices=np.array(logits_rows, dtype=np.int32),
        edit_rows=np.array(edit_rows, dtype=np.int32),
        edit_starts=np.zeros(len(edit_rows), dtype=np.int32),
        edit_offsets=offsets,
        edit_blocks=i32(edit_blocks),
    )
    plan.validate()
    return plan, expected


def make_scenario(vocab_size: int, seed: int = 0) -> Scenario:
    rng = np.random.default_rng(seed)
    a = rng.integers(0, vocab_size, 14)
    # C shares A's first two blocks (8 tokens): its prompt hits the prefix cache.
    c = np.concatenate([a[:8], rng.integers(0, vocab_size, 5)])
    seqs = {
        "A": _Seq(a, [3, 7, 1, 20], row=2),  # prefill 11, then decodes 11, 12, 13
        "B": _Seq(rng.integers(0, vocab_size, 13), [30, 2, 11, 25], row=0),  # chunks 6 and 7
        "C": _Seq(c, [3, 7, 12, 15], num_computed=8, row=5),  # computes only positions 8..12
        "E": _Seq(rng.integers(0, vocab_size, 6), [40, 41], row=1),  # prefill 5, then decode 5
        "F": _Seq(rng.integers(0, vocab_size, 7), [9, 33], row=3),  # chunks 3 (no logits), 4
    }
    steps = [
        [("F", 3, "none")],  # a mid-prompt chunk only: no logits anywhere
        [("A", 11, "all"), ("B", 6, "all")],
        [("A", 1, "all"), ("B", 7, "all"), ("C", 5, "all"), ("E", 5, "all"), ("F", 4, "last")],
        [("A", 1, "all")],
        [("E", 1, "all"), ("A", 1, "all")],
    ]
    scenario = Scenario(sequences={name: s.tokens for name, s in seqs.items()})
    for step_id, work in enumerate(steps):
        plan, expected = _plan(step_id, seqs, work)
        scenario.plans.append(plan)
        scenario.expected.append(expected)
    return scenario


def hf_reference(model_dir: Path, scenario: Scenario) -> list[torch.Tensor]:
    """Hugging Face's fp32 logits for every expected row of every plan (Qwen3 or Qwen3-MoE,
    as the checkpoint's config says)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    full: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tokens in scenario.sequences.items():
            ids = torch.from_numpy(tokens.astype(np.int64)).unsqueeze(0)
            full[name] = model(ids).logits[0]  # [len, vocab]
    return [
        torch.stack([full[name][p] for name, p in rows])
        if rows
        else torch.zeros(0, model.config.vocab_size)
        for rows in scenario.expected
    ]


# -- running ----------------------------------------------------------------------------------


def run_scenario(
    model_dir: Path, plans: list[StepPlan], tp: Any, **runner_fields: Any
) -> list[torch.Tensor | None]:
    """Load `model_dir` on this rank and execute the plans; logits per plan (None off rank 0).
    `runner_fields`: further RunnerConfig fields (e.g. attention_backend="triton")."""
    from rank_worker.runner.model_runner import ModelRunner
    from rank_worker.runner_config import RunnerConfig

    config = RunnerConfig(
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_KV_BLOCKS,
        **runner_fields,
    )
    runner = ModelRunner(model_dir, config, tp, "cpu")
    runner.init_kv_cache(runner.determine_num_kv_blocks())
    return [runner.execute(plan) for plan in plans]


def _collective_checks(tp: Any) -> dict[str, Any]:
    from rank_worker import tp as tpmod

    x = torch.full((2, 3), float(tp.rank + 1))
    gathered = tpmod.gather_to_first(torch.full((2, 1), float(tp.rank)), tp, dim=-1)
    return {
        "all_reduce": tpmod.all_reduce(x, tp).tolist(),
        "all_gather": tpmod.all_gather(torch.tensor([[tp.rank]]), tp, dim=-1).tolist(),
        "gather_to_first": None if gathered is None else gathered.tolist(),
        "broadcast": tpmod.broadcast_bytes(b"plan\x00bytes" if tp.is_first else None, tp),
        "broadcast_empty": tpmod.broadcast_bytes(b"" if tp.is_first else None, tp),
        "min_int": tpmod.all_reduce_min_int(100 - 7 * tp.rank, tp),
    }


def tp_worker(
    rank: int,
    world_size: int,
    init_file: str,
    cases: dict[str, tuple[str, list[bytes]] | tuple[str, list[bytes], dict[str, Any]]],
    out_dir: str,
) -> None:
    """Entry point of one spawned rank: joins the gloo group, runs the collective checks and
    every case (with its RunnerConfig fields, if any), and saves what it saw to
    `out_dir/rank<r>.pt` (or its traceback on error)."""
    from rank_worker.tp import destroy_process_group, init_process_group

    torch.set_num_threads(1)  # N ranks share two cores; more threads only thrash
    out = Path(out_dir) / f"rank{rank}.pt"
    try:
        # A short timeout turns a collective that one failed rank never joins into an error
        # on the others instead of a hang.
        tp = init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            init_method=f"file://{init_file}",
            timeout_s=60,
        )
        result: dict[str, Any] = {"tp": (tp.rank, tp.size), "collectives": _collective_checks(tp)}
        for name, (model_dir, encoded, *fields) in cases.items():
            plans = [StepPlan.decode(b) for b in encoded]
            result[name] = run_scenario(Path(model_dir), plans, tp, **(fields[0] if fields else {}))
        torch.save(result, out)
        destroy_process_group()
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        raise


def hf_greedy(checkpoint: Path | str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Transformers' greedy continuations of `prompts` in float32 from a dense checkpoint
    (`moe_cases.hf_greedy` on the loaded model): the reference the engine must equal."""
    from transformers import Qwen3ForCausalLM

    from tests.moe_cases import hf_greedy as greedy_of

    model = Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return greedy_of(model, prompts, max_tokens)
