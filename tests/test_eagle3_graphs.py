"""The EAGLE-3 draft chain's CUDA graphs (`rank_worker.spec.eagle3_graphs`).

CPU: the chain over the padded static buffers (what a graph replays), run eagerly before any
capture, against the plain step-by-step chain (`Eagle3Runner._eager_chain`): the same drafts for
every wanted draft, the same head cache, and nothing written by padding rows or by rows past
their last wanted draft. Batches of 5 rows (run in 8) and 3 (in 4), rows wanting 1 to k drafts,
a row whose target states were not kept; the torch and the Triton (interpreted) backends.
GPU (`gpu` marker): captured and replayed against the eager chain.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from rank_worker.runner.model_runner import ModelRunner
from rank_worker.runner_config import RunnerConfig
from rank_worker.tp import TPInfo
from shm_ipc.step_plan import Command, StepPlan

K = 3
BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Prompt lengths; each sequence i owns blocks 1 + 8i .. 8 + 8i (never block 0, which padding
# rows read), enough for its prompt, a verify entry and a chain.
LENS = (3, 8, 13, 5, 20)


@pytest.fixture(scope="module")
def pair():
    from tp_engine.testing.eagle3_heads import cached_eagle3_pair

    return cached_eagle3_pair()


def _plan(
    command: Command,
    tokens: list[list[int]],
    seq_lens: list[int],
    rows: list[int],
    new_rows: list[int] | tuple[int, ...] = (),
    **sections: np.ndarray,
) -> StepPlan:
    """A plan of `tokens[i]` (the last of sequence `rows[i]`'s `seq_lens[i]` positions);
    `new_rows` are written from column 0 with their blocks."""
    q = np.array([len(t) for t in tokens], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    blocks = [list(range(1 + 8 * r, 9 + 8 * r)) for r in new_rows]
    plan = StepPlan(
        step_id=0,
        command=command,
        input_ids=np.concatenate([np.asarray(t) for t in tokens]).astype(np.int32),
        query_start_loc=qsl,
        seq_lens=np.asarray(seq_lens, dtype=np.int32),
        rows=np.asarray(rows, dtype=np.int32),
        logits_indices=(qsl[1:] - 1).astype(np.int32)
        if command == Command.RUN
        else np.zeros(0, np.int32),
        edit_rows=np.asarray(new_rows, dtype=np.int32),
        edit_starts=np.zeros(len(blocks), dtype=np.int32),
        edit_offsets=np.arange(len(blocks) + 1, dtype=np.int32) * 8,
        edit_blocks=np.asarray([b for bs in blocks for b in bs], dtype=np.int32),
    )
    if sections:
        plan = plan.with_sections(**sections)
    plan.validate()
    return plan


def scenario() -> list[StepPlan]:
    """Prefill five sequences; draft for all five (wanting 3, 1, 2, 3, 3: a batch of 5 in 8);
    verify entries of 1 + wanted tokens beside a sixth prompt; draft for three of the five and
    for the sixth at a position past its prompt, whose states no RUN plan computed (hidden
    zeros; 4 rows in 4)."""
    rng = np.random.default_rng(0)
    tok = lambda n: rng.integers(0, 643, n).tolist()  # noqa: E731
    wanted = np.array([3, 1, 2, 3, 3], dtype=np.int32)
    everyone = list(range(5))
    verify_lens = [n + 1 + w for n, w in zip(LENS, wanted, strict=True)]
    rows = [0, 2, 4]
    again = [LENS[r] + 2 for r in rows]  # a position the verify entry computed
    return [
        _plan(Command.RUN, [tok(n) for n in LENS], list(LENS), everyone, new_rows=everyone),
        _plan(Command.DRAFT, [tok(1)] * 5, list(LENS), everyone, eagle_drafts=wanted),
        _plan(
            Command.RUN,
            [*(tok(1 + w) for w in wanted), tok(6)],
            [*verify_lens, 6],
            [*everyone, 5],
            new_rows=[5],
        ),
        _plan(
            Command.DRAFT,
            [tok(1)] * 4,
            [*again, 7],
            [*rows, 5],
            eagle_drafts=np.array([2, 3, 1, 3], dtype=np.int32),
        ),
    ]


def run(pair, backend: str, device: str, chain: str) -> tuple[list, torch.Tensor, ModelRunner]:
    """The scenario's drafts (each DRAFT plan's, masked to what each row wants) and the head's
    cache; `chain`: "eager", "padded" (the graphs' buffers, uncaptured) or "captured" (GPU)."""
    target, head = pair
    config = RunnerConfig(
        max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, max_num_seqs=8,
        max_num_batched_tokens=64, num_kv_blocks=56, eagle3_head=str(head),
        attention_backend=backend, enforce_eager=True,
    )  # fmt: skip
    runner = ModelRunner(target, config, TPInfo(0, 1), device)
    runner.init_kv_cache(runner.determine_num_kv_blocks())
    runner.kept = []  # per DRAFT plan: which rows found their kept target states
    if chain != "eager":
        runner.eagle3.build_chain_graphs(K, 8, capture=chain == "captured")
    drafts = []
    for step_id, plan in enumerate(scenario()):
        plan = dataclasses.replace(plan, step_id=step_id)
        if plan.command == Command.RUN:
            runner.execute(plan)
            continue
        wanted = plan.section("eagle_drafts")
        kept = runner.eagle3._kept_states(plan).abs().sum(dim=1) > 0  # [R] states found
        runner.kept.append(kept.tolist())
        out = runner.execute_draft(plan).cpu()
        drafts.append([out[i, :w].tolist() for i, w in enumerate(wanted)])
    k_cache, v_cache = runner.eagle3.kv_cache
    return drafts, torch.stack([k_cache, v_cache]).cpu(), runner


@pytest.mark.parametrize(("backend", "device"), [("torch", "cpu"), ("triton", KERNEL_DEVICE)])
def test_padded_chain_matches_the_eager_chain(pair, backend, device):
    eager, eager_cache, _ = run(pair, backend, device, "eager")
    padded, padded_cache, runner = run(pair, backend, device, "padded")
    chain = runner.eagle3.chain_graphs
    assert (chain.num_padded_runs, chain.num_replays) == (2, 0)
    assert chain.sizes == [1, 2, 4, 8]
    assert [len(d) for d in eager] == [5, 4]
    assert [[len(row) for row in d] for d in eager] == [[3, 1, 2, 3, 3], [2, 3, 1, 3]]
    assert runner.kept == [[True] * 5, [True, True, True, False]]
    assert padded == eager
    # fp32: a padded batch changes only the matmuls' row count (summation order), compounded
    # over the chain's steps: a few 1e-6.
    torch.testing.assert_close(padded_cache, eager_cache, atol=1e-5, rtol=1e-4)
    assert not padded_cache[:, 0].any()  # block 0: read by padding rows, written by nobody
    # Row 1 wanted one draft: its chain wrote entry L-1 alone, the verify entry then L-1 and L;
    # entry L+1 (the chain's third step, were it not masked) holds nothing.
    entries = padded_cache[0].flatten(0, 1).abs().sum(dim=(1, 2)) != 0  # [slots]
    slot = lambda pos: (1 + 8 * 1) * BLOCK_SIZE + pos  # noqa: E731  (row 1's blocks: 9, 10, ..)
    assert entries[slot(LENS[1])] and not entries[slot(LENS[1] + 1)]


def test_chain_fits_plans_of_at_most_k_drafts(pair):
    """A plan whose rows want more drafts than the graphs chain (or more rows than the largest
    size) is not theirs: `Eagle3Runner.draft` runs it step by step."""
    _, _, runner = run(pair, "torch", "cpu", "eager")
    runner.eagle3.build_chain_graphs(2, 8, capture=False)
    chain = runner.eagle3.chain_graphs
    assert chain.can_run(3, np.array([2, 1, 2])) and not chain.can_run(3, np.array([1, 3, 1]))
    assert not chain.can_run(9, np.array([1] * 9))
    with pytest.raises(ValueError, match="at least one step"):
        runner.eagle3.build_chain_graphs(0, 8, capture=False)


@pytest.mark.gpu
def test_captured_chain_matches_the_eager_chain_gpu(pair):
    eager, eager_cache, _ = run(pair, "triton", "cuda", "eager")
    captured, captured_cache, runner = run(pair, "triton", "cuda", "captured")
    chain = runner.eagle3.chain_graphs
    assert sorted(chain.graphs) == [1, 2, 4, 8]
    assert (chain.num_replays, chain.num_padded_runs) == (2, 0)
    assert captured == eager  # fp32 greedy drafts
    torch.testing.assert_close(captured_cache, eager_cache, atol=1e-4, rtol=1e-4)
    assert not captured_cache[:, 0].any()


@pytest.mark.parametrize(("backend", "device"), [("torch", "cpu"), ("triton", KERNEL_DEVICE)])
def test_entries_store_what_the_full_layer_stores(pair, backend, device):
    """A RUN plan's entries are written by `store_entries` (K/V only, no attention or MLP):
    the same cache bytes as the head's full forward over the same entries."""
    _, _, runner = run(pair, backend, device, "eager")
    head, cache = runner.eagle3.head, runner.eagle3.kv_cache
    g = torch.Generator().manual_seed(3)
    hidden_size = head.cfg.hidden_size
    embeds = torch.randn(6, hidden_size, generator=g).to(device)
    hidden = torch.randn(6, hidden_size, generator=g).to(device)
    # Two sequences of 3 entries at positions 4..6 and 9..11, slots in blocks 50 and 51 (unused
    # by the scenario); one entry with slot -1 stores nothing.
    positions = torch.tensor([4, 5, 6, 9, 10, 11], device=device)
    slots = torch.tensor([200, 201, 202, 205, -1, 207], device=device)
    meta = _meta(slots, positions, device)
    blank = [torch.zeros_like(c) for c in cache]
    head.store_entries(embeds, hidden, positions, slots, blank)
    full = [torch.zeros_like(c) for c in cache]
    head(embeds, hidden, positions, meta, full)
    for got, want in zip(blank, full, strict=True):
        assert torch.equal(got, want)
        assert got.flatten(0, 1)[[200, 201, 202, 205, 207]].abs().sum(dim=(1, 2)).all()
        assert not got.flatten(0, 1)[206].any()


def _meta(slots: torch.Tensor, positions: torch.Tensor, device: str):
    """Metadata of two sequences of three entries ending at positions 6 and 11 (blocks 50, 51
    hold them; the rest of each table is block 0)."""
    from rank_worker.attention.metadata import AttentionMetadata

    table = torch.zeros(2, 4, dtype=torch.int32, device=device)
    table[0, 1], table[1, 2] = 50, 51
    seq_lens = positions.view(2, 3)[:, -1].int() + 1
    return AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.tensor([0, 3, 6], dtype=torch.int32, device=device),
        seq_lens=seq_lens,
        block_table=table,
        max_query_len=3,
        max_seq_len=12,
        query_start_loc_host=np.array([0, 3, 6], dtype=np.int32),
        seq_lens_host=seq_lens.cpu().numpy(),
    )


# -- the engine over the graphs' data path ----------------------------------------------------


def _engine_run(pair, tp: int, prompts) -> tuple[list, list, object]:
    """Greedy outputs one prompt at a time (batch 1: uniform verify steps), then all together
    (rows wanting unequal drafts, mixed steps); the acceptance per draft position; the runner."""
    from tests.test_speculative_eagle3 import GREEDY, _generate, _llm

    target, head = pair
    with _llm(target, tp, head) as llm:
        outs = [_generate(llm, [p], GREEDY)[0] for p in prompts]
        outs.append(_generate(llm, prompts, GREEDY))
        stats = llm.engine.spec_stats
        runner = llm.engine.runner
        counters = (
            None
            if runner.graph_runner is None
            else (
                runner.eagle3.chain_graphs.num_padded_runs,
                dict(runner.graph_runner.eager_runs_by_query_len),
            )
        )
        return outs, [stats.num_drafts, *stats.accepted_per_pos], counters


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_drafts_through_the_padded_graphs(pair, monkeypatch, tp):
    """`TP_ENGINE_DECODE_GRAPHS=padded`: every rank runs the target's decode and verify steps
    and the draft chain over the graphs' padded buffers (at TP 2 a rank that did not would fail
    the collectives). Greedy outputs equal transformers; at TP 1 the drafts are the eager
    engine's (the same acceptance at every position)."""
    from rank_worker.runner.cuda_graphs import ENV_VAR
    from tests.moe_cases import hf_greedy
    from tests.test_speculative_eagle3 import MAX_TOKENS, _hf, _prompts

    prompts = _prompts(4, (1, 8, 13, 21), seed=1)
    expected = hf_greedy(_hf(pair[0]), prompts, MAX_TOKENS)
    monkeypatch.setenv(ENV_VAR, "padded")  # the ranks, spawned below, inherit it
    outs, acceptance, counters = _engine_run(pair, tp, prompts)
    assert outs == [*expected, expected]
    chain_runs, target_runs = counters
    assert chain_runs > 0
    assert target_runs[1 + K] > 0, target_runs  # verify steps, their states from the buffers
    assert acceptance[1] > 0, acceptance  # drafts were accepted
    if tp == 1:
        monkeypatch.delenv(ENV_VAR)
        eager_outs, eager_acceptance, eager_counters = _engine_run(pair, 1, prompts)
        assert eager_counters is None and eager_outs == outs
        assert acceptance == eager_acceptance


def test_chain_graphs_come_and_go_with_the_targets(pair, monkeypatch):
    """Built after the target's graphs (k steps, max_num_seqs rows), dropped with them (what
    sleep does before it gives back the embedding the graphs read), built again on wake."""
    from rank_worker.runner.cuda_graphs import ENV_VAR

    monkeypatch.setenv(ENV_VAR, "padded")
    target, head = pair
    config = RunnerConfig(
        max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, max_num_seqs=6,
        max_num_batched_tokens=64, num_kv_blocks=56, eagle3_head=str(head),
        attention_backend="torch", num_speculative_tokens=K,
    )  # fmt: skip
    runner = ModelRunner(target, config, TPInfo(0, 1), "cpu")
    runner.init_kv_cache(runner.determine_num_kv_blocks())
    chain = runner.eagle3.chain_graphs
    assert runner.graph_runner is not None and chain is not None
    assert (chain.num_steps, chain.sizes) == (K, [1, 2, 4, 6])
    assert runner.release_graphs()
    assert runner.graph_runner is None and runner.eagle3.chain_graphs is None
    assert chain.kv_cache is None  # released
    assert not runner.release_graphs()
    runner.capture_graphs()
    assert runner.eagle3.chain_graphs is not None and runner.eagle3.chain_graphs is not chain
    runner.release()
