"""StepPlan -> forward inputs: the one-copy staging path against the straightforward per-array
conversion, the fallback for plans larger than the buffers, and placeholder ids.

CPU: everything but pinning and the event that guards a pinned buffer, which the `gpu` test
checks by delaying the stream so that the host runs two steps ahead of the copies.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from rank_worker.input_prep import StepInputBuffers, StepInputs, prepare_inputs
from rank_worker.runner_config import RunnerConfig
from shm_ipc.step_plan import Command, StepPlan

# Limits of the buffers in these tests: T_max, B_max, W_max (B'_max = T_max + B_max).
MAX_TOKENS, MAX_SEQS, MAX_WIDTH = 64, 8, 6


def small_buffers(device: str = "cpu") -> StepInputBuffers:
    return StepInputBuffers(
        max_num_tokens=MAX_TOKENS,
        max_num_seqs=MAX_SEQS,
        max_block_table_width=MAX_WIDTH,
        device=device,
    )


def random_plan(
    rng: np.random.Generator, step_id: int, max_seqs: int = MAX_SEQS, max_tokens: int = MAX_TOKENS
) -> StepPlan:
    """A consistent random step: leading decodes, then prefill chunks, within the limits; the
    logits rows are one per sampling sequence plus, sometimes, prompt-logprob rows after them."""
    num_seqs = int(rng.integers(1, max_seqs + 1))
    num_decodes = int(rng.integers(0, num_seqs + 1))
    budget = max_tokens - num_seqs  # every sequence has at least one token
    q_lens = np.ones(num_seqs, dtype=np.int32)
    for i in range(num_decodes, num_seqs):
        extra = int(rng.integers(0, budget // 2 + 1))
        q_lens[i] += extra
        budget -= extra
    cached = rng.integers(0, 20, num_seqs).astype(np.int32)
    seq_lens = (cached + q_lens).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t = int(starts[-1])
    width = int(rng.integers(1, MAX_WIDTH + 1))
    sampled = starts[1:] - 1
    prompt_rows = np.sort(rng.choice(t, size=int(rng.integers(0, t + 1)), replace=False))
    plan = StepPlan(
        step_id=step_id,
        command=Command.RUN,
        input_ids=rng.integers(0, 1000, t).astype(np.int32),
        positions=np.concatenate(
            [np.arange(c, s, dtype=np.int32) for c, s in zip(cached, seq_lens, strict=True)]
        ),
        slot_mapping=rng.integers(-1, 500, t).astype(np.int32),
        query_start_loc=starts,
        seq_lens=seq_lens,
        block_table=rng.integers(0, 100, (num_seqs, width)).astype(np.int32),
        logits_indices=np.concatenate([sampled, prompt_rows]).astype(np.int32),
    )
    plan.validate()
    return plan


def as_shared_memory(plan: StepPlan) -> StepPlan:
    """The plan as a worker sees it: read-only views into one buffer."""
    return StepPlan.decode(plan.encode())


def reference(plan: StepPlan) -> dict[str, torch.Tensor]:
    """The straightforward conversion, one array at a time."""

    def conv(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.array(arr)).to(dtype)

    return {
        "input_ids": conv(plan.input_ids, torch.int64),
        "positions": conv(plan.positions, torch.int64),
        "slot_mapping": conv(plan.slot_mapping, torch.int64),
        "query_start_loc": conv(plan.query_start_loc, torch.int32),
        "seq_lens": conv(plan.seq_lens, torch.int32),
        "block_table": conv(plan.block_table, torch.int32),
        "logits_indices": conv(plan.logits_indices, torch.int64),
    }


def flatten(inputs: StepInputs) -> dict[str, torch.Tensor]:
    meta = inputs.meta
    return {
        "input_ids": inputs.input_ids,
        "positions": inputs.positions,
        "slot_mapping": meta.slot_mapping,
        "query_start_loc": meta.query_start_loc,
        "seq_lens": meta.seq_lens,
        "block_table": meta.block_table,
        "logits_indices": inputs.logits_indices,
    }


def assert_matches(inputs: StepInputs, plan: StepPlan) -> None:
    got, want = flatten(inputs), reference(plan)
    for name, ref in want.items():
        t = got[name].cpu()
        assert t.dtype == ref.dtype and t.shape == ref.shape, name
        assert torch.equal(t, ref), f"step {plan.step_id}: {name}"
    meta = inputs.meta
    assert meta.query_start_loc_host.tolist() == plan.query_start_loc.tolist()
    assert meta.seq_lens_host.tolist() == plan.seq_lens.tolist()
    assert meta.max_query_len == int(np.diff(plan.query_start_loc).max())
    assert meta.max_seq_len == int(plan.seq_lens.max())
    assert inputs.step_id == plan.step_id


def test_buffered_inputs_match_the_straightforward_conversion():
    rng = np.random.default_rng(0)
    buffers = small_buffers()
    for step in range(200):
        plan = as_shared_memory(random_plan(rng, step))
        assert buffers.fits(plan)
        inputs = prepare_inputs(plan, "cpu", buffers=buffers)
        assert_matches(inputs, plan)
        # Every view starts 16-byte aligned, as its own allocation would (Triton cares).
        assert all(t.data_ptr() % 16 == 0 for t in flatten(inputs).values()), f"step {step}"
        assert_matches(prepare_inputs(plan, "cpu"), plan)  # no buffers: allocation path
    assert buffers.num_fallbacks == 0


def test_buffers_are_reused_and_results_last_one_step():
    rng = np.random.default_rng(1)
    buffers = small_buffers()
    a, b = random_plan(rng, 0), random_plan(rng, 1)
    first = prepare_inputs(a, "cpu", buffers=buffers)
    assert_matches(first, a)
    second = prepare_inputs(b, "cpu", buffers=buffers)
    assert_matches(second, b)

    # The int32 layout views of both steps sit in the same persistent memory: step 0's are
    # documented as valid only until the next call.
    def storage(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    assert storage(first.meta.seq_lens) == storage(second.meta.block_table)
    # The int64 tensors are the step's own (widened on the device), and outlive it.
    assert torch.equal(first.input_ids, reference(a)["input_ids"])


def uniform_plan(
    rng: np.random.Generator, step_id: int, t: int, b: int, w: int, all_rows: bool
) -> StepPlan:
    """t tokens split evenly over b prefills, a block table w wide; logits for each sequence's
    last row and, with `all_rows`, prompt-logprob rows for every token (the most there are)."""
    starts = np.linspace(0, t, b + 1).astype(np.int32)
    rows = [starts[1:] - 1] + ([np.arange(t)] if all_rows else [])
    plan = StepPlan(
        step_id=step_id,
        command=Command.RUN,
        input_ids=rng.integers(0, 1000, t).astype(np.int32),
        positions=np.arange(t, dtype=np.int32),
        slot_mapping=np.arange(t, dtype=np.int32),
        query_start_loc=starts,
        seq_lens=np.diff(starts).astype(np.int32),
        block_table=rng.integers(0, 100, (b, w)).astype(np.int32),
        logits_indices=np.concatenate(rows).astype(np.int32),
    )
    plan.validate()
    return plan


def test_largest_plan_fits_and_a_larger_one_falls_back():
    rng = np.random.default_rng(2)
    buffers = small_buffers()
    largest = uniform_plan(rng, 7, MAX_TOKENS, MAX_SEQS, MAX_WIDTH, all_rows=True)
    assert buffers.fits(largest)
    assert_matches(prepare_inputs(largest, "cpu", buffers=buffers), largest)
    assert buffers.num_fallbacks == 0

    too_wide = uniform_plan(rng, 8, MAX_TOKENS, MAX_SEQS, MAX_WIDTH + 1, all_rows=True)
    too_long = uniform_plan(rng, 9, 2 * MAX_TOKENS, MAX_SEQS, 1, all_rows=False)
    for n, plan in enumerate([too_wide, as_shared_memory(too_long)], start=1):
        assert not buffers.fits(plan)
        assert_matches(prepare_inputs(plan, "cpu", buffers=buffers), plan)
        assert buffers.num_fallbacks == n
    # The buffers still serve the next ordinary step.
    plan = random_plan(rng, 10)
    assert_matches(prepare_inputs(plan, "cpu", buffers=buffers), plan)
    assert buffers.num_fallbacks == 2


def test_buffers_for_config_are_sized_for_the_largest_step():
    config = RunnerConfig(
        max_model_len=100, block_size=16, max_num_seqs=4, max_num_batched_tokens=32
    )
    buffers = StepInputBuffers.for_config(config, "cpu")
    # 3T + (B+1) + B + B*W + (T+B), W = ceil(100 / 16) = 7, each rounded up to 4 elements
    assert buffers.capacity == 3 * 32 + 8 + 4 + 4 * 7 + 36


def test_buffers_refuse_another_device():
    with pytest.raises(ValueError, match="buffers live on cpu"):
        prepare_inputs(random_plan(np.random.default_rng(3), 0), "meta", buffers=small_buffers())


# -- placeholders ----------------------------------------------------------------------------


def with_placeholders(
    plan: StepPlan, rng: np.random.Generator, num_rows: int
) -> tuple[StepPlan, torch.Tensor]:
    """Replace some input ids by placeholders for rows of a fake previous step whose sampled
    tokens (`last_sampled`, returned) are the replaced ids."""
    ids = plan.input_ids.astype(np.int64)
    chosen = rng.choice(plan.num_tokens, size=min(num_rows, plan.num_tokens), replace=False)
    rows = rng.choice(num_rows, size=chosen.size, replace=False)
    last_sampled = torch.from_numpy(rng.integers(0, 1000, num_rows))
    last_sampled[torch.from_numpy(rows)] = torch.from_numpy(ids[chosen])
    placeholder_ids = plan.input_ids.copy()
    placeholder_ids[chosen] = -rows - 1
    return dataclasses.replace(plan, input_ids=placeholder_ids), last_sampled


def test_placeholders_resolve_from_last_sampled():
    rng = np.random.default_rng(4)
    buffers = small_buffers()
    for step in range(50):
        plan = random_plan(rng, step)
        held, last_sampled = with_placeholders(plan, rng, int(rng.integers(1, 12)))
        held = as_shared_memory(held)
        assert (held.input_ids < 0).any()
        got = prepare_inputs(held, "cpu", buffers=buffers, last_sampled=last_sampled)
        assert_matches(got, plan)  # the real ids, and everything else as it was
    # A plan without placeholders ignores last_sampled.
    plan = random_plan(rng, 99)
    got = prepare_inputs(
        plan, "cpu", buffers=buffers, last_sampled=torch.zeros(0, dtype=torch.long)
    )
    assert_matches(got, plan)


def test_placeholders_in_a_plan_that_falls_back():
    buffers = small_buffers()
    plan = random_plan(np.random.default_rng(5), 3)
    big = dataclasses.replace(
        plan, block_table=np.zeros((plan.num_seqs, MAX_WIDTH * 20), dtype=np.int32)
    )
    held, last_sampled = with_placeholders(big, np.random.default_rng(6), 4)
    got = prepare_inputs(held, "cpu", buffers=buffers, last_sampled=last_sampled)
    assert buffers.num_fallbacks == 1
    assert torch.equal(got.input_ids, reference(plan)["input_ids"])


def test_unresolvable_placeholders_name_the_step():
    plan = random_plan(np.random.default_rng(7), 12)
    held = dataclasses.replace(plan, input_ids=plan.input_ids.copy())
    held.input_ids[0] = -3  # row 2 of the previous step
    with pytest.raises(ValueError, match=r"step 12: .*no last_sampled"):
        prepare_inputs(held, "cpu", buffers=small_buffers())
    with pytest.raises(ValueError, match=r"step 12: .*row 2, but last_sampled holds 2 rows"):
        prepare_inputs(held, "cpu", last_sampled=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="step 12: last_sampled must be 1-D"):
        prepare_inputs(held, "cpu", last_sampled=torch.zeros(3, 1, dtype=torch.long))
    got = prepare_inputs(held, "cpu", last_sampled=torch.tensor([1, 2, 77]))
    assert int(got.input_ids[0]) == 77


# -- GPU: the pinned buffers' hazard ---------------------------------------------------------


@pytest.mark.gpu
def test_pinned_buffers_wait_for_their_copy_gpu():
    """The host runs three steps ahead of a stalled stream: step 2 reuses step 0's pinned
    buffer and must wait for its copy, or step 0 would read step 2's inputs."""
    rng = np.random.default_rng(8)
    buffers = small_buffers("cuda")
    assert all(h.is_pinned() for h in buffers._host)
    for _ in range(5):
        plans = [as_shared_memory(random_plan(rng, i)) for i in range(3)]
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # a few tenths of a second of GPU time
        results = [prepare_inputs(p, "cuda", buffers=buffers) for p in plans]
        torch.cuda.synchronize()
        for inputs, plan in zip(results, plans, strict=True):
            # The int64 tensors are each step's own; the int32 views alias the device buffer,
            # which holds the last step's by now.
            want = reference(plan)
            for name in ("input_ids", "positions", "slot_mapping", "logits_indices"):
                assert torch.equal(flatten(inputs)[name].cpu(), want[name]), name
        assert_matches(results[-1], plans[-1])
