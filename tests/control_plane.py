"""Tiny factories and a checked step loop for the control-plane tests (no model, no CUDA)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import numpy as np

from rank_worker.inputs.block_tables import BlockTables
from rank_worker.inputs.input_prep import positions_of
from shm_ipc.step_plan import StepPlan
from tp_engine.config import EngineConfig
from tp_engine.core.drafting import schedule_step
from tp_engine.core.kv.block_manager import BlockManager
from tp_engine.core.plan_builder import build_step_plan
from tp_engine.core.running_batch import RunningBatch
from tp_engine.core.scheduled_step import DraftProposer, ScheduledStep
from tp_engine.core.scheduler import Scheduler
from tp_engine.core.sequence import Sequence
from tp_engine.features.speculative import accept_drafts
from tp_engine.sampling_params import SamplingParams

EOS = 0


def make_scheduler(
    num_blocks: int = 8,
    block_size: int = 4,
    max_model_len: int = 64,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 32,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    proposer: DraftProposer | None = None,
    **bm_kwargs,
) -> Scheduler:
    config = EngineConfig(
        max_model_len=max_model_len,
        max_num_seqs=min(max_num_seqs, max_num_batched_tokens),
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        enable_chunked_prefill=enable_chunked_prefill,
        enable_prefix_caching=enable_prefix_caching,
        num_kv_blocks=num_blocks,
    )
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching, **bm_kwargs)
    sched = Scheduler(config, bm, eos_token_ids=[EOS])
    if proposer is not None:
        _proposers[sched] = proposer  # the step pipeline's, which `Stepper` plays
    return sched


# Each scheduler's proposer (speculative decoding): the step pipeline asks it, not the scheduler.
_proposers: WeakKeyDictionary[Scheduler, DraftProposer] = WeakKeyDictionary()


def proposer_of(sched: Scheduler) -> DraftProposer | None:
    return _proposers.get(sched)


def schedule(sched: Scheduler) -> ScheduledStep:
    """One step scheduled as the engine's pipeline does, drafts included."""
    return schedule_step(sched, proposer_of(sched))


def make_seq(request_id: str, tokens: list[int], max_tokens: int | None = 4, **params) -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(max_tokens=max_tokens, **params))


def next_token(seq: Sequence) -> int:
    """A deterministic fake model: the next token depends only on the tokens so far, never 0."""
    return 1 + (sum(seq.token_ids) * 31 + seq.num_tokens) % 97


@dataclass(frozen=True)
class StepView:
    """A scheduled step as the tests read it: its sequences (captured when it was scheduled,
    since rows change hands) beside the scheduler's arrays, as plain lists."""

    step: ScheduledStep
    scheduled: list[Sequence]
    num_scheduled_tokens: list[int]
    starts: list[int]
    samples: list[bool]
    # For a decode whose input is the in-flight step's sample: that sample's row; else None.
    input_rows: list[int | None]
    # Each sequence's computed tokens when the step was scheduled (its batch row's).
    num_computed: list[int]
    # Each entry's drafted tokens (speculative decoding; empty lists without).
    drafts: list[list[int]]

    @classmethod
    def of(cls, step: ScheduledStep, batch: RunningBatch) -> StepView:
        seqs = [batch.seqs[row] for row in step.rows.tolist()]
        assert all(s is not None for s in seqs)
        rows = step.placeholder_rows.tolist()
        drafts: list[list[int]] = [[] for _ in seqs]
        if step.num_drafts is not None:
            assert step.draft_tokens is not None
            flat, offset = step.draft_tokens.tolist(), 0
            for i, n in enumerate(step.num_drafts.tolist()):
                drafts[i], offset = flat[offset : offset + n], offset + n
        return cls(
            step,
            seqs,  # type: ignore[arg-type]
            step.num_scheduled.tolist(),
            step.starts.tolist(),
            step.samples.tolist(),
            [r if p else None for r, p in zip(rows, step.reads_placeholder.tolist(), strict=True)],
            batch.num_computed[step.rows].tolist(),
            drafts,
        )

    @property
    def preempted(self) -> list[Sequence]:
        return self.step.preempted

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def reference_plan_arrays(
    out: StepView, block_size: int, in_flight: StepView | None = None
) -> dict[str, np.ndarray]:
    """The step's plan computed one token at a time, the obvious way: its arrays, and the slot
    of every token (which the ranks derive from their table mirrors).

    `in_flight`: the step scheduled before `out` and not yet applied (asynchronous scheduling);
    a sequence in both starts after its in-flight tokens, and a token it has not received yet
    is the placeholder `-1 - row` of its sampled row in `in_flight`.
    """
    pending_tokens: dict[int, int] = {}
    pending_rows: dict[int, int] = {}
    if in_flight is not None:
        sampling = [s for s, smp in zip(in_flight.scheduled, in_flight.samples, strict=True) if smp]
        pending_rows = {id(s): row for row, s in enumerate(sampling)}
        pending_tokens = {
            id(s): n
            for s, n in zip(in_flight.scheduled, in_flight.num_scheduled_tokens, strict=True)
        }
    ids, pos, slots, qsl, lens, logits = [], [], [], [0], [], []
    for seq, n, samples, computed, drafts in zip(
        out.scheduled, out.num_scheduled_tokens, out.samples, out.num_computed, out.drafts,
        strict=True,
    ):  # fmt: skip
        start = computed + pending_tokens.get(id(seq), 0)
        for p in range(start, start + n):
            if p < seq.num_tokens:
                ids.append(seq.token_ids[p])
            elif drafts:  # a verify entry: its last token, then its drafts
                ids.append(drafts[p - seq.num_tokens])
            else:
                assert p == seq.num_tokens and id(seq) in pending_rows, (seq, p)
                ids.append(-1 - pending_rows[id(seq)])
            pos.append(p)
            slots.append(seq.block_table[p // block_size] * block_size + p % block_size)
        qsl.append(qsl[-1] + n)
        lens.append(start + n)
        if samples:  # every verified position of a verify entry, else the last token
            logits += range(qsl[-1] - 1 - len(drafts), qsl[-1])
    as_i32 = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
    return {
        "input_ids": as_i32(ids),
        "positions": as_i32(pos),
        "slot_mapping": as_i32(slots),
        "query_start_loc": as_i32(qsl),
        "seq_lens": as_i32(lens),
        "rows": as_i32([s.row for s in out.scheduled]),
        "logits_indices": as_i32(logits),
    }


class TableMirror:
    """A worker's view: replays every plan's table edits, as each rank does."""

    def __init__(self, sched: Scheduler) -> None:
        self.tables = BlockTables(
            sched.batch.max_rows, sched.batch.block_table.shape[1], sched.block_size, "cpu"
        )

    def apply(self, plan: StepPlan) -> None:
        self.tables.apply(plan)

    def slots(self, plan: StepPlan) -> np.ndarray:
        rows = np.repeat(plan.rows, np.diff(plan.query_start_loc))
        return self.tables.slots(rows, positions_of(plan))

    def check(self, sched: Scheduler) -> None:
        """The mirror holds exactly rank 0's tables: every running sequence's blocks in its
        row, and no blocks in a free row."""
        running = {seq.row: seq for seq in sched.running}
        for row in range(sched.batch.max_rows):
            length = int(self.tables.lengths[row])
            seq = running.get(row)
            if seq is None:
                assert length == 0, f"row {row} is free on rank 0 but holds {length} blocks"
            else:
                assert self.tables.host[row, :length].tolist() == seq.block_table, (row, seq)


def check_plan(
    plan: StepPlan,
    out: StepView,
    block_size: int,
    mirror: TableMirror,
    in_flight: StepView | None = None,
) -> None:
    """`plan` is the reference's, once `mirror` has replayed its edits."""
    plan.validate()
    mirror.apply(plan)
    expected = reference_plan_arrays(out, block_size, in_flight)
    got = {
        "positions": positions_of(plan),
        "slot_mapping": mirror.slots(plan),
        **{name: getattr(plan, name) for name in expected if hasattr(plan, name)},
    }
    for name, want in expected.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)


class Stepper:
    """Runs schedule -> plan -> fake sample -> update, checking every invariant after each step:
    the plan against the per-token reference, a worker's replayed tables against rank 0's, and
    the block manager's integrity.

    With `async_scheduling` the loop is pipelined like `LLMEngine.step`: step t is scheduled and
    its plan built before step t-1 is applied, then step t is "sampled" (after the update, as
    the engine samples after applying the previous step).
    """

    def __init__(
        self,
        sched: Scheduler,
        sample: Callable[[Sequence], int] = next_token,
        async_scheduling: bool = False,
    ) -> None:
        self.sched = sched
        self.sample = sample
        self.async_scheduling = async_scheduling
        self.step_id = 0
        self.mirror = TableMirror(sched)
        # Asynchronous scheduling: the step scheduled last and its sampled tokens.
        self.in_flight: tuple[StepView, list[int]] | None = None

    def has_work(self) -> bool:
        return self.sched.has_unfinished() or self.in_flight is not None

    def step(self) -> tuple[StepView, list[Sequence]]:
        scheduled = schedule(self.sched)
        out = StepView.of(scheduled, self.sched.batch)
        self.check()
        if not out.is_empty:
            plan = build_step_plan(scheduled, self.step_id)
            in_flight = self.in_flight[0] if self.in_flight is not None else None
            check_plan(plan, out, self.sched.block_size, self.mirror, in_flight)
            # The plan carried every change since the last one: the mirror is up to date.
            self.mirror.check(self.sched)
            # The pipeline's order: the tiers' copies leave with the plan, and a sequence whose
            # blocks they copy up computes in it only if the step says it waits for them.
            bm = self.sched.block_manager
            loading = [seq.seq_id for seq in out.scheduled if bm.loading(seq)]
            assert not loading or scheduled.reads_copies_up, f"{loading} read blocks in flight"
            bm.take_copies()
            self.step_id += 1
        if self.async_scheduling:
            finished = self._update(*self.in_flight) if self.in_flight is not None else []
            self.in_flight = None if out.is_empty else (out, self._sample(out))
        else:
            finished = self._update(out, self._sample(out))
        self.check()
        return out, finished

    def _update(self, out: StepView, tokens: list[int]) -> list[Sequence]:
        step = out.step
        if step.num_drafts is None:
            return self.sched.update(step, np.asarray(tokens, dtype=np.int64)).finished
        assert step.draft_tokens is not None and step.sampled_drafts is not None
        verdict = accept_drafts(np.asarray(tokens), step.sampled_drafts, step.draft_tokens)
        return self.sched.update(step, verdict.token_ids, verdict.num_emitted).finished

    def _sample(self, out: StepView) -> list[int]:
        """The fake model's token at every sampled position: a verify entry's positions see
        the drafts before them as the sequence's tokens."""
        tokens = []
        for seq, smp, drafts in zip(out.scheduled, out.samples, out.drafts, strict=True):
            if not smp:
                continue
            tokens.append(self.sample(seq))
            if drafts:
                ahead = Sequence("ahead", list(seq.token_ids))
                for draft in drafts:
                    ahead.token_ids.append(draft)
                    tokens.append(self.sample(ahead))
        return tokens

    def run_to_completion(self, max_steps: int = 10_000) -> list[Sequence]:
        done: list[Sequence] = []
        for _ in range(max_steps):
            if not self.has_work():
                return done
            had_in_flight = self.in_flight is not None
            out, finished = self.step()
            assert not out.is_empty or had_in_flight, (
                "no progress while requests are unfinished (livelock)"
            )
            done += finished
        raise AssertionError(f"not finished after {max_steps} steps")

    def check(self) -> None:
        self.sched.check_integrity()
        for seq in self.sched.waiting:
            assert seq.block_table == [] and seq.num_computed_tokens == 0, seq
            assert seq.num_inflight_tokens == seq.num_placeholders == 0, seq
            assert seq.row is None, seq
        batch = self.sched.batch
        for seq in self.sched.running:
            # The row mirrors the sequence.
            row = seq.row
            assert row is not None and batch.seqs[row] is seq and batch.serial[row] == seq.serial
            # At most the step in flight and the one just scheduled.
            assert 0 <= batch.num_placeholders[row] <= 2, seq
            # (A verify entry in flight also computes its drafts, past the known tokens.)
            proposer = proposer_of(self.sched)
            drafts = proposer.num_speculative_tokens if proposer else 0
            assert (
                batch.scheduled_end(row) <= seq.num_tokens + batch.num_placeholders[row] + drafts
            ), seq
            assert batch.num_tokens[row] == seq.num_tokens, seq
            assert batch.last_token[row] == seq.token_ids[-1], seq
            assert batch.block_table[row, : batch.num_blocks[row]].tolist() == seq.block_table


def expected_output(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    """What the fake model generates for a prompt, computed without any scheduler."""
    seq = Sequence("ref", prompt)
    while seq.num_output_tokens < max_tokens and seq.num_tokens < max_model_len:
        token = next_token(seq)
        seq.token_ids.append(token)
        if token == EOS:
            break
    return seq.output_token_ids
