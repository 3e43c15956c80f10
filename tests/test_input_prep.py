"""StepPlan + table mirror -> forward inputs: the one-copy staging path against a per-token
reference over a hand-kept copy of the tables, the fallback for steps larger than the buffers,
and placeholder ids.

Both layouts run on CPU: the CPU's (one buffer, the host table read by numpy) and the GPU's
(two host buffers guarded by copy events, a separate device table edited by the cells that
travel with the step and read by a row gather, which hands the kernels strided views). The
GPU's copy events are checked with a stand-in stream that fails when a host buffer changes
while its copy may still read it. Only pinning and real CUDA events are left to the `gpu`
test, which delays the stream so that the host runs two steps ahead of the copies.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from rank_worker.inputs.block_tables import BlockTables
from rank_worker.inputs.input_prep import StepInputBuffers, StepInputs, prepare_inputs
from rank_worker.runner_config import RunnerConfig
from shm_ipc.step_plan import Command, StepPlan

# Limits of the buffers in these tests: T_max, B_max, B'_max, edited cells; the tables.
MAX_TOKENS, MAX_SEQS, MAX_LOGITS, MAX_CELLS = 64, 8, 72, 40
ROWS, WIDTH, BLOCK_SIZE = 16, 12, 4


def small_buffers(device: str = "cpu", **kwargs) -> StepInputBuffers:
    return StepInputBuffers(
        max_num_tokens=MAX_TOKENS,
        max_num_seqs=MAX_SEQS,
        max_num_logits=MAX_LOGITS,
        max_edit_cells=MAX_CELLS,
        device=device,
        **kwargs,
    )


def new_tables(device: str = "cpu", **kwargs) -> BlockTables:
    return BlockTables(ROWS, WIDTH, BLOCK_SIZE, device, **kwargs)


class CopyHazard(AssertionError):
    pass


class CheckingStream:
    """A copy stream that holds the host to the contract of `rank_worker.inputs.copy_stream`: a copy
    happens at once, but its source must stay unchanged until an event marked after it has
    been waited for (a GPU may read it that late). Breaking it raises CopyHazard."""

    def __init__(self) -> None:
        self.in_flight: list[tuple[torch.Tensor, torch.Tensor]] = []  # (source, its contents)
        self.num_copies = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)
        self.in_flight.append((src, src.clone()))
        self.num_copies += 1

    def mark(self) -> CheckingStream.Event:
        return CheckingStream.Event(self, self.num_copies)

    def settle(self, count: int) -> None:
        for src, contents in self.in_flight[:count]:
            if not torch.equal(src, contents):
                raise CopyHazard("a host buffer changed while its copy was in flight")
        del self.in_flight[:count]

    def finish(self) -> None:
        """The end of the stream (torch.cuda.synchronize): every copy has read its source."""
        self.settle(len(self.in_flight))

    class Event:
        def __init__(self, stream: CheckingStream, upto: int) -> None:
            self.stream, self.upto = stream, upto  # copies [0, upto) precede the event

        def synchronize(self) -> None:
            # Copies settle in order; an earlier wait may have settled some of ours already.
            settled = self.stream.num_copies - len(self.stream.in_flight)
            self.stream.settle(max(0, self.upto - settled))


class Reference:
    """The tables as rank 0 holds them (row -> block ids), kept by hand."""

    def __init__(self) -> None:
        self.rows: dict[int, list[int]] = {}

    def random_plan(
        self, rng: np.random.Generator, step_id: int, max_tokens: int = MAX_TOKENS
    ) -> StepPlan:
        """A consistent random step: leading decodes, then prefill chunks; new rows, rows that
        grow, and rows given up, as edits; logits rows for every sequence's last token and,
        sometimes, prompt-logprob rows after them."""
        edits: list[tuple[int, int, list[int]]] = []
        for row in list(self.rows):
            if rng.random() < 0.2:  # given up
                del self.rows[row]
                edits.append((row, 0, []))
        num_seqs = int(rng.integers(1, MAX_SEQS + 1))
        rows = rng.choice(ROWS, size=num_seqs, replace=False)
        num_decodes = int(rng.integers(0, num_seqs + 1))
        budget = max_tokens - num_seqs
        q_lens = np.ones(num_seqs, dtype=np.int32)
        for i in range(num_decodes, num_seqs):
            extra = int(rng.integers(0, min(budget, max_tokens // 5) + 1))
            q_lens[i] += extra
            budget -= extra
        seq_lens = np.zeros(num_seqs, dtype=np.int32)
        for i, row in enumerate(rows.tolist()):
            held = self.rows.get(row)
            cached = int(rng.integers(0, 12))
            seq_lens[i] = cached + q_lens[i]
            need = -(-int(seq_lens[i]) // BLOCK_SIZE)
            if held is None:
                self.rows[row] = blocks = rng.integers(0, 500, need).tolist()
                edits.append((row, 0, blocks))
            elif len(held) < need:
                more = rng.integers(0, 500, need - len(held)).tolist()
                edits.append((row, len(held), more))
                held += more
            else:
                seq_lens[i] = min(int(seq_lens[i]), len(held) * BLOCK_SIZE)
                q_lens[i] = min(int(q_lens[i]), int(seq_lens[i]))
        starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        t = int(starts[-1])
        prompt_rows = np.sort(rng.choice(t, size=int(rng.integers(0, t + 1)), replace=False))
        offsets = np.concatenate([[0], np.cumsum([len(b) for _, _, b in edits])]).astype(np.int32)
        plan = StepPlan(
            step_id=step_id,
            command=Command.RUN,
            input_ids=rng.integers(0, 1000, t).astype(np.int32),
            query_start_loc=starts,
            seq_lens=seq_lens,
            rows=rows.astype(np.int32),
            logits_indices=np.concatenate([starts[1:] - 1, prompt_rows]).astype(np.int32),
            edit_rows=np.array([r for r, _, _ in edits], dtype=np.int32),
            edit_starts=np.array([s for _, s, _ in edits], dtype=np.int32),
            edit_offsets=offsets,
            edit_blocks=np.array([x for _, _, b in edits for x in b], dtype=np.int32),
        )
        plan.validate()
        return plan

    def prefill_plan(self, step_id: int, rows: list[int], num_tokens: int) -> StepPlan:
        """Fresh `rows` (given up first if held), each prefilling `num_tokens` tokens, with
        logits for every token."""
        edits = [(row, 0, []) for row in rows if row in self.rows]
        for row in rows:
            self.rows[row] = blocks = list(range(100 * row, 100 * row + -(-num_tokens // 4)))
            edits.append((row, 0, blocks))
        t = num_tokens * len(rows)
        offsets = np.concatenate([[0], np.cumsum([len(b) for _, _, b in edits])]).astype(np.int32)
        return StepPlan(
            step_id=step_id,
            command=Command.RUN,
            input_ids=np.arange(t, dtype=np.int32),
            query_start_loc=np.arange(0, t + 1, num_tokens, dtype=np.int32),
            seq_lens=np.full(len(rows), num_tokens, dtype=np.int32),
            rows=np.array(rows, dtype=np.int32),
            logits_indices=np.arange(t, dtype=np.int32),
            edit_rows=np.array([r for r, _, _ in edits], dtype=np.int32),
            edit_starts=np.zeros(len(edits), dtype=np.int32),
            edit_offsets=offsets,
            edit_blocks=np.array([x for _, _, b in edits for x in b], dtype=np.int32),
        )

    def inputs(self, plan: StepPlan) -> dict[str, torch.Tensor]:
        """The inputs computed one token at a time."""
        ids, pos, slots = [], [], []
        for i in range(plan.num_seqs):
            lo, hi = plan.query_start_loc[i], plan.query_start_loc[i + 1]
            blocks = self.rows[int(plan.rows[i])]
            for j, token in enumerate(range(lo, hi)):
                p = int(plan.seq_lens[i]) - int(hi - lo) + j
                ids.append(int(plan.input_ids[token]))
                pos.append(p)
                slots.append(blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        return {
            "input_ids": torch.tensor(ids, dtype=torch.int64),
            "positions": torch.tensor(pos, dtype=torch.int64),
            "slot_mapping": torch.tensor(slots, dtype=torch.int64),
            "query_start_loc": torch.tensor(plan.query_start_loc.tolist(), dtype=torch.int32),
            "seq_lens": torch.tensor(plan.seq_lens.tolist(), dtype=torch.int32),
            "logits_indices": torch.tensor(plan.logits_indices.tolist(), dtype=torch.int64),
        }

    def check(self, inputs: StepInputs, plan: StepPlan, input_ids: np.ndarray | None = None):
        want = self.inputs(plan)
        if input_ids is not None:
            want["input_ids"] = torch.from_numpy(input_ids.astype(np.int64))
        got = flatten(inputs)
        for name, ref in want.items():
            t = got[name].cpu()
            assert t.dtype == ref.dtype and t.shape == ref.shape, name
            assert torch.equal(t, ref), f"step {plan.step_id}: {name}"
        table = inputs.meta.block_table.cpu()
        for i in range(plan.num_seqs):
            n = -(-int(plan.seq_lens[i]) // BLOCK_SIZE)
            assert table[i, :n].tolist() == self.rows[int(plan.rows[i])][:n], f"row {i}"
        meta = inputs.meta
        assert meta.query_start_loc_host.tolist() == plan.query_start_loc.tolist()
        assert meta.seq_lens_host.tolist() == plan.seq_lens.tolist()
        assert meta.max_query_len == int(np.diff(plan.query_start_loc).max())
        assert meta.max_seq_len == int(plan.seq_lens.max())
        assert inputs.step_id == plan.step_id


def as_shared_memory(plan: StepPlan) -> StepPlan:
    """The plan as a worker sees it: read-only views into one buffer."""
    return StepPlan.decode(plan.encode())


def flatten(inputs: StepInputs) -> dict[str, torch.Tensor]:
    meta = inputs.meta
    return {
        "input_ids": inputs.input_ids,
        "positions": inputs.positions,
        "slot_mapping": meta.slot_mapping,
        "query_start_loc": meta.query_start_loc,
        "seq_lens": meta.seq_lens,
        "logits_indices": inputs.logits_indices,
    }


def test_buffered_inputs_match_the_per_token_reference():
    rng = np.random.default_rng(0)
    ref, buffers = Reference(), small_buffers()
    buffered, allocated = new_tables(), new_tables()
    for step in range(200):
        plan = as_shared_memory(ref.random_plan(rng, step))
        inputs = prepare_inputs(plan, buffered, buffers=buffers)
        ref.check(inputs, plan)
        # Every view starts 16-byte aligned, as its own allocation would (Triton cares).
        assert all(t.data_ptr() % 16 == 0 for t in flatten(inputs).values()), f"step {step}"
        ref.check(prepare_inputs(plan, allocated), plan)  # no buffers: allocation path
        # The mirror holds rank 0's tables, no more: a row given up holds nothing.
        for row in range(ROWS):
            blocks = ref.rows.get(row, [])
            assert buffered.lengths[row] == len(blocks), (step, row)
            assert buffered.host[row, : len(blocks)].tolist() == blocks, (step, row)
    assert buffers.num_fallbacks == 0


def gpu_layout() -> tuple[StepInputBuffers, BlockTables, CheckingStream]:
    """The GPU's staging and tables, on CPU tensors, with a stream that checks the events."""
    stream = CheckingStream()
    return small_buffers(double_buffered=True, stream=stream), new_tables(device_copy=True), stream


def test_gpu_layout_matches_the_per_token_reference_on_cpu():
    """Two host buffers taking turns, the cells of each step travelling in its one copy and
    scattered into the separate device table, the step's tables gathered by row: the same
    inputs as the reference, and no host buffer rewritten while its copy was in flight."""
    rng = np.random.default_rng(10)
    ref = Reference()
    buffers, tables, stream = gpu_layout()
    assert buffers._device_buf.data_ptr() not in {h.data_ptr() for h in buffers._host}
    assert tables.device_table.data_ptr() != tables.host.ctypes.data
    strided = 0
    for step in range(200):
        plan = as_shared_memory(ref.random_plan(rng, step))
        held, last_sampled = with_placeholders(plan, rng, int(rng.integers(1, 12)))
        inputs = prepare_inputs(held, tables, buffers=buffers, last_sampled=last_sampled)
        ref.check(inputs, held, input_ids=plan.input_ids)
        # The kernels get the GPU's view: the full table's row stride, the step's width.
        table = inputs.meta.block_table
        assert table.stride() == (WIDTH, 1)
        strided += not table.is_contiguous()
        assert torch.equal(tables.device_table, torch.from_numpy(tables.host)), step
    stream.finish()
    assert strided > 100 and stream.num_copies == 200 and buffers.num_fallbacks == 0


def test_a_host_buffer_rewritten_before_its_copy_is_done_is_caught():
    """The stand-in catches the hazard the events prevent: with the wait left out (an event
    that returns at once), the third step overwrites the first step's buffer under its copy."""

    class Forgetful(CheckingStream):
        def mark(self):
            super().mark()
            return type("NoWait", (), {"synchronize": lambda self: None})()

    rng = np.random.default_rng(11)
    ref, stream = Reference(), Forgetful()
    buffers = small_buffers(double_buffered=True, stream=stream)
    tables = new_tables(device_copy=True)
    for step in range(3):
        prepare_inputs(ref.random_plan(rng, step), tables, buffers=buffers)
    with pytest.raises(CopyHazard):
        stream.finish()


def test_gathered_block_tables_feed_the_attention_kernels():
    """The device-side gather's strided views go straight into the Triton kernels (interpreted
    here), which read the same pages as the reference does from the host tables."""
    from kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
    from kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref

    rng = np.random.default_rng(12)
    ref = Reference()
    buffers, tables, stream = gpu_layout()
    gen = torch.Generator().manual_seed(0)
    cache_shape = (500, BLOCK_SIZE, 2, 16)  # block ids of the random plans are < 500
    k_cache = torch.randn(cache_shape, generator=gen)
    v_cache = torch.randn(cache_shape, generator=gen)
    for step in range(4):
        plan = ref.random_plan(rng, step, max_tokens=24)
        meta = prepare_inputs(plan, tables, buffers=buffers).meta
        query = torch.randn(plan.num_tokens, 4, 16, generator=gen)
        args = (query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens)
        host_table = torch.from_numpy(tables.host[plan.rows, : meta.block_table.shape[1]])
        got = paged_prefill_attention(*args, meta.block_table, meta.max_query_len, 0.25)
        want = paged_prefill_attention_ref(*args, host_table, meta.max_query_len, 0.25)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        # Each sequence's last token as a decode batch, on the same strided table.
        last = meta.query_start_loc[1:] - 1
        decode_args = (query[last.long()], k_cache, v_cache, meta.seq_lens)
        got = paged_decode_attention(*decode_args, meta.block_table, 0.25, 2)
        want = paged_decode_attention_ref(*decode_args, host_table, 0.25)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    stream.finish()


def test_buffers_are_reused_and_results_last_one_step():
    rng = np.random.default_rng(1)
    ref, buffers, tables = Reference(), small_buffers(), new_tables()
    a = ref.random_plan(rng, 0)
    first = prepare_inputs(a, tables, buffers=buffers)
    b = ref.random_plan(rng, 1)
    second = prepare_inputs(b, tables, buffers=buffers)
    ref.check(second, b)

    # Every input of both steps (int64 ones included: widened on the host) sits in the same
    # persistent memory: step 0's are documented as valid only until the next call.
    def storage(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    for name, tensor in flatten(first).items():
        assert storage(tensor) == storage(second.meta.query_start_loc), name
    # A step of the same shape reuses the same views.
    again = prepare_inputs(b, new_tables(), buffers=buffers)
    assert again.positions is second.positions


def test_the_largest_step_fits_and_a_larger_one_falls_back():
    rng = np.random.default_rng(2)
    ref, buffers, tables = Reference(), small_buffers(), new_tables()
    largest = ref.random_plan(rng, 7)
    largest = dataclasses.replace(
        largest, logits_indices=np.arange(largest.num_tokens, dtype=np.int32)
    )
    ref.check(prepare_inputs(largest, tables, buffers=buffers), largest)
    assert buffers.num_fallbacks == 0

    too_long = ref.prefill_plan(8, [1, 2, 3], 40)  # 120 tokens, each with logits
    ref.check(prepare_inputs(as_shared_memory(too_long), tables, buffers=buffers), too_long)
    assert buffers.num_fallbacks == 1
    # The buffers still serve the next ordinary step.
    plan = ref.random_plan(rng, 10)
    ref.check(prepare_inputs(plan, tables, buffers=buffers), plan)
    assert buffers.num_fallbacks == 1


def test_buffers_for_config_are_sized_for_the_largest_step():
    config = RunnerConfig(
        max_model_len=100, block_size=16, max_num_seqs=4, max_num_batched_tokens=32
    )
    buffers = StepInputBuffers.for_config(config, "cpu")
    # int64 (two elements each): 3T + B' + B; int32: (B+1) + B + T (adapter slots) + 3 *
    # cells, cells = ceil(32 / 16) + 2 * 4; each segment rounded up to 4 elements; B' = T (no
    # max_num_logits_rows given: every token's row).
    assert buffers.capacity == 2 * (3 * 32 + 32 + 4) + 8 + 4 + 32 + 32


def test_buffers_refuse_another_device():
    plan = Reference().random_plan(np.random.default_rng(3), 0)
    with pytest.raises(ValueError, match="buffers live on cpu"):
        prepare_inputs(plan, BlockTables(ROWS, WIDTH, BLOCK_SIZE, "meta"), buffers=small_buffers())


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
    ref, buffers, tables = Reference(), small_buffers(), new_tables()
    for step in range(50):
        plan = ref.random_plan(rng, step)
        held, last_sampled = with_placeholders(plan, rng, int(rng.integers(1, 12)))
        held = as_shared_memory(held)
        assert (held.input_ids < 0).any()
        got = prepare_inputs(held, tables, buffers=buffers, last_sampled=last_sampled)
        ref.check(got, held, input_ids=plan.input_ids)  # the real ids, the rest as it was
    # A plan without placeholders ignores last_sampled.
    plan = ref.random_plan(rng, 99)
    got = prepare_inputs(
        plan, tables, buffers=buffers, last_sampled=torch.zeros(0, dtype=torch.long)
    )
    ref.check(got, plan)


def test_unresolvable_placeholders_name_the_step():
    ref = Reference()
    plan = ref.random_plan(np.random.default_rng(7), 12)
    held = dataclasses.replace(plan, input_ids=plan.input_ids.copy())
    held.input_ids[0] = -3  # row 2 of the previous step
    with pytest.raises(ValueError, match=r"step 12: .*no last_sampled"):
        prepare_inputs(held, new_tables(), buffers=small_buffers())
    with pytest.raises(ValueError, match=r"step 12: .*row 2, but last_sampled holds 2 rows"):
        prepare_inputs(held, new_tables(), last_sampled=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="step 12: last_sampled must be 1-D"):
        prepare_inputs(held, new_tables(), last_sampled=torch.zeros(3, 1, dtype=torch.long))
    got = prepare_inputs(held, new_tables(), last_sampled=torch.tensor([1, 2, 77]))
    assert int(got.input_ids[0]) == 77


def test_an_edit_past_the_table_width_names_the_step():
    plan = Reference().random_plan(np.random.default_rng(9), 4)
    wide = dataclasses.replace(
        plan,
        edit_rows=np.array([0], np.int32),
        edit_starts=np.array([WIDTH - 1], np.int32),
        edit_offsets=np.array([0, 2], np.int32),
        edit_blocks=np.array([1, 2], np.int32),
    )
    with pytest.raises(ValueError, match=f"step 4: an edit writes block column {WIDTH}"):
        prepare_inputs(wide, new_tables())


# -- GPU: the pinned buffers' hazard and the device table ------------------------------------


@pytest.mark.gpu
def test_pinned_buffers_wait_for_their_copy_gpu():
    """The host runs three steps ahead of a stalled stream: step 2 reuses step 0's pinned
    buffer and must wait for its copy, or step 0 would read step 2's inputs. The device table
    gets every step's edits in order."""
    rng = np.random.default_rng(8)
    ref, buffers, tables = Reference(), small_buffers("cuda"), new_tables("cuda")
    assert all(h.is_pinned() for h in buffers._host)
    for _ in range(5):
        plans, wants = [], []
        for i in range(3):
            plans.append(as_shared_memory(ref.random_plan(rng, i)))
            # Now: the next plan may give up a row this one reads (KeyError: 10 on the H100).
            wants.append(ref.inputs(plans[-1]))
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # a few tenths of a second of GPU time
        results: list[StepInputs] = []
        # Every input aliases the device buffer, valid until the next step's copy lands:
        # cloned in stream order, each step's are what its kernels would read.
        snapshots = []
        for p in plans:
            inputs = prepare_inputs(p, tables, buffers=buffers)
            snapshots.append({name: t.clone() for name, t in flatten(inputs).items()})
            results.append(inputs)
        torch.cuda.synchronize()
        for got, want in zip(snapshots, wants, strict=True):
            for name in ("input_ids", "positions", "slot_mapping", "logits_indices"):
                assert torch.equal(got[name].cpu(), want[name]), name
        ref.check(results[-1], plans[-1])
        assert torch.equal(tables.device_table.cpu(), torch.from_numpy(tables.host))
