"""The scheduler with drafted tokens (speculative decoding), against the fake model: verify
entries, the rollback of rejected drafts (K/V not counted, surplus blocks returned, the
workers' table mirrors following), stop checks inside an accepted run, the token budget and
preemption. Outputs must be those of the fake model run one token at a time."""

from __future__ import annotations

import numpy as np
import pytest

from tests.control_plane import (
    Stepper,
    StepView,
    make_scheduler,
    make_seq,
    next_token,
    schedule,
)
from tp_engine.core.plan_builder import build_step_plan
from tp_engine.core.scheduler import Scheduler
from tp_engine.core.sequence import Sequence
from tp_engine.features.speculative import accept_drafts


class OracleProposer:
    """Drafts the fake model's own continuation, each draft replaced by a random token with
    probability `wrong`, and a random number of them (0 .. the limit)."""

    def __init__(
        self, k: int, seed: int, wrong: float = 0.3, after: bool = False, full: bool = False
    ) -> None:
        self.num_speculative_tokens = k
        # Every draft allowed, not a random number of them.
        self.full = full
        # Like a draft model: drafts made once blocks are allocated, exactly as many as asked.
        self.drafts_after_allocation = after
        self.rng = np.random.default_rng(seed)
        self.wrong = wrong
        self.sched: Scheduler | None = None
        self.calls: list[tuple[list[int], list[int]]] = []

    def eligible(self, rows: np.ndarray) -> np.ndarray:
        return rows % 5 != 4  # some rows are never drafted

    def propose(self, rows: np.ndarray, max_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        assert self.sched is not None
        self.calls.append((rows.tolist(), max_drafts.tolist()))
        drafts: list[int] = []
        num = np.zeros(rows.size, dtype=np.int32)
        for i, (row, limit) in enumerate(zip(rows.tolist(), max_drafts.tolist(), strict=True)):
            seq = self.sched.batch.seqs[row]
            assert seq is not None
            ahead = Sequence("ahead", list(seq.token_ids))
            num[i] = (
                limit
                if self.drafts_after_allocation or self.full
                else int(self.rng.integers(0, limit + 1))
            )
            if self.drafts_after_allocation:
                # Its blocks are there: every drafted position has a slot.
                blocks = self.sched.batch.num_blocks[row]
                assert seq.num_tokens - 1 + limit <= blocks * self.sched.block_size, seq
            for _ in range(num[i]):
                token = next_token(ahead)
                if self.rng.random() < self.wrong:
                    token = int(self.rng.integers(1, 98))
                ahead.token_ids.append(token)
                drafts.append(token)
        return np.asarray(drafts, dtype=np.int32), num


def reference(prompt: list[int], max_tokens: int, stop_ids: tuple[int, ...], max_len: int):
    seq = Sequence("ref", list(prompt))
    while seq.num_output_tokens < max_tokens and seq.num_tokens < max_len:
        token = next_token(seq)
        seq.token_ids.append(token)
        if token in stop_ids:
            break
    return seq.output_token_ids


class DraftPreemptions:
    """Counts the preemptions that drafts caused: those after which the request that preempted
    would have fitted without its draft positions, in the free blocks and the blocks other
    rows hold for draft positions. (With synchronous scheduling a block past a row's known
    tokens holds nothing but drafts.)"""

    def __init__(self, sched: Scheduler) -> None:
        self.count = 0
        self.total = 0
        bm, batch, bs = sched.block_manager, sched.batch, sched.block_size
        allocate, preempt = bm.allocate_slots, sched.allocation.preempt
        asked: list[tuple[Sequence, int]] = []  # the last allocation's sequence and end

        def allocate_slots(seq, num_new_tokens, cached_prefix=None, *, start=None):
            end = (seq.num_computed_tokens if start is None else start) + num_new_tokens
            asked[:] = [(seq, end)]
            return allocate(seq, num_new_tokens, cached_prefix, start=start)

        def _preempt(victim):
            seq, end = asked[0]
            # Blocks the request needs for known tokens alone (drafts sit past them).
            need = -(-min(end, seq.num_tokens) // bs) - len(seq.block_table)
            rows = batch.order
            draft_held = int(
                np.maximum(batch.num_blocks[rows] - -(-batch.num_tokens[rows] // bs), 0).sum()
            )
            self.total += 1
            self.count += need <= bm.num_free_blocks + draft_held
            preempt(victim)

        bm.allocate_slots = allocate_slots
        sched.allocation.preempt = _preempt


def spec_scheduler(
    k: int, seed: int, after: bool = False, **kwargs
) -> tuple[Scheduler, OracleProposer]:
    proposer = OracleProposer(k, seed, after=after)
    sched = make_scheduler(proposer=proposer, **kwargs)
    proposer.sched = sched
    return sched, proposer


@pytest.mark.parametrize("after", [False, True], ids=["before_blocks", "after_blocks"])
# (Seed 1's requests never need more than the small pool at once: nothing would preempt.)
@pytest.mark.parametrize("seed", [0, 2, 3, 4, 5, 6])
@pytest.mark.parametrize(
    "knobs",
    [
        {"num_blocks": 64, "max_num_batched_tokens": 64},
        {"num_blocks": 64, "max_num_batched_tokens": 6, "max_num_seqs": 4},
        {"num_blocks": 9, "max_num_batched_tokens": 32},
        {"num_blocks": 64, "max_num_batched_tokens": 64, "enable_prefix_caching": False},
    ],
    ids=["roomy", "small_budget", "small_pool", "no_prefix_cache"],
)
def test_outputs_equal_one_token_at_a_time(seed, knobs, after):
    rng = np.random.default_rng(seed)
    sched, proposer = spec_scheduler(
        k=4, seed=seed, after=after, block_size=4, max_model_len=48, **knobs
    )
    st = Stepper(sched)
    draft_preemptions = DraftPreemptions(sched)
    cases = []
    for i in range(6):
        prompt = rng.integers(1, 98, size=int(rng.integers(1, 14))).tolist()
        max_tokens = int(rng.integers(1, 24))
        # Some stop on a token the fake model emits midway, often inside a run of drafts.
        full = reference(prompt, max_tokens, (), 48)
        stop_ids = (full[len(full) // 2],) if i % 2 and len(full) > 2 else ()
        seq = make_seq(f"s{i}", prompt, max_tokens=max_tokens, stop_token_ids=list(stop_ids))
        sched.add(seq)
        cases.append((seq, reference(prompt, max_tokens, stop_ids, 48)))
    for _ in range(400):
        if not st.has_work():
            break
        st.step()
        batch = sched.batch
        for seq in sched.running:
            # Rejected drafts gave their blocks back: no block past the known tokens.
            assert batch.num_blocks[seq.row] <= -(-seq.num_tokens // sched.block_size), seq
    assert not sched.has_unfinished()
    for seq, want in cases:
        assert seq.output_token_ids == want, seq
    assert sched.block_manager.usage == 0.0
    assert any(sum(m) for _, m in proposer.calls), "nothing was ever drafted"
    # Drafts are cut to the free blocks: they never make anyone be preempted.
    assert draft_preemptions.count == 0
    assert draft_preemptions.total == sched.num_preemptions
    if knobs["num_blocks"] < 64:
        assert sched.num_preemptions > 0


def test_drafts_are_capped_by_max_tokens_and_the_budget():
    sched, proposer = spec_scheduler(k=5, seed=0, block_size=4, max_num_batched_tokens=6)
    st = Stepper(sched)
    sched.add(make_seq("a", [1, 2, 3], max_tokens=3))
    sched.add(make_seq("b", [4, 5, 6], max_tokens=20))
    st.step()  # both prefilled (one token each sampled)
    proposer.rng = np.random.default_rng(1)
    proposer.wrong = 0.0
    proposer.propose_all = True
    out, _ = st.step()
    _rows, limits = proposer.calls[-1]
    # a has 1 output token of 3: 2 more at most, so at most 1 draft; b up to k.
    assert limits == [1, 5]
    # The budget (6 tokens) holds both entries' own tokens and at most 4 drafts.
    assert sum(out.num_scheduled_tokens) <= 6
    assert all(len(d) == n - 1 for d, n in zip(out.drafts, out.num_scheduled_tokens, strict=True))


@pytest.mark.parametrize("after", [False, True], ids=["before_blocks", "after_blocks"])
def test_drafts_are_cut_to_the_free_blocks_rather_than_preempt(after):
    """A pool of 3 blocks of 4: a holds 1 (3 tokens), b 2 (8 tokens), none free. a's own token
    fits its block and so does b's; a's drafts have the one free position of its block, b's
    none. Nobody is preempted, and the drafts that fit are verified. (Later, the sequences'
    own tokens need more blocks than there are: those preemptions are not the drafts'.)"""
    proposer = OracleProposer(k=3, seed=0, wrong=0.0, after=after, full=True)
    sched = make_scheduler(num_blocks=3, block_size=4, proposer=proposer)
    proposer.sched = sched
    st = Stepper(sched)
    draft_preemptions = DraftPreemptions(sched)
    a = make_seq("a", [1, 2], max_tokens=8)
    b = make_seq("b", [3, 4, 5, 6, 7, 8, 9], max_tokens=1 + 4)
    sched.add(a)
    sched.add(b)
    st.step()  # both prompts computed, one token sampled each
    assert (a.num_tokens, b.num_tokens, sched.block_manager.num_free_blocks) == (3, 8, 0)
    out, _ = st.step()
    assert out.preempted == [] and sched.num_preemptions == 0
    assert out.scheduled == [a, b] and out.num_scheduled_tokens == [2, 1]
    assert len(out.drafts[0]) == 1 and out.drafts[1] == []
    assert a.num_output_tokens == 3  # its draft was accepted
    st.run_to_completion()
    assert draft_preemptions.count == 0
    for seq in (a, b):
        want = reference(seq.prompt_token_ids, seq.sampling_params.max_tokens, (), 64)
        assert seq.output_token_ids == want


def test_discard_returns_the_blocks_reserved_for_drafts():
    """A verify step that is never applied (the forward failed after its plan went out): its
    drafts' block goes back at once, the workers' mirrors hear of it with the next plan, and
    the sequence goes on to the same output."""
    proposer = OracleProposer(k=3, seed=0, wrong=0.0, full=True)
    sched = make_scheduler(num_blocks=8, block_size=4, proposer=proposer)
    proposer.sched = sched
    st = Stepper(sched)
    a = make_seq("a", [1, 2], max_tokens=8)
    sched.add(a)
    st.step()
    free = sched.block_manager.num_free_blocks
    step = schedule(sched)  # position 2 and drafts at 3, 4, 5: a second block
    assert step.num_drafts is not None and step.num_drafts.tolist() == [3]
    assert len(a.block_table) == 2 and sched.block_manager.num_free_blocks == free - 1
    st.mirror.apply(build_step_plan(step, st.step_id))
    st.step_id += 1
    sched.discard(step)
    assert len(a.block_table) == 1 and sched.block_manager.num_free_blocks == free
    assert sched.batch.num_blocks[a.row] == 1
    st.check()
    st.run_to_completion()  # each plan checked against the mirror, which saw the truncation
    assert a.output_token_ids == reference([1, 2], 8, (), 64)


def test_update_says_how_many_tokens_each_entry_gave_its_sequence():
    """What the counters of output read: a run of drafts cut by a stop gave its tokens up to
    the stop, and an entry whose sequence was aborted before the step was applied gave none."""
    proposer = OracleProposer(k=3, seed=0, wrong=0.0, full=True)
    sched = make_scheduler(num_blocks=16, block_size=4, proposer=proposer)
    proposer.sched = sched
    st = Stepper(sched)
    full = reference([1, 2], 8, (), 64)
    assert full[2] not in full[:2]
    a = make_seq("a", [1, 2], max_tokens=8, stop_token_ids=[full[2]])  # its 3rd token stops it
    b = make_seq("b", [3, 4, 5], max_tokens=8)
    c = make_seq("c", [6, 7], max_tokens=8)
    for seq in (a, b, c):
        sched.add(seq)
    st.step()  # the prompts, and each one's first token
    step = schedule(sched)  # each verifies 3 drafts, all right
    assert step.num_drafts is not None and step.num_drafts.tolist() == [3, 3, 3]
    tokens = st._sample(StepView.of(step, sched.batch))
    sched.abort("c")
    verdict = accept_drafts(np.asarray(tokens), step.sampled_drafts, step.draft_tokens)
    assert verdict.num_emitted.tolist() == [4, 4, 4]
    result = sched.update(step, verdict.token_ids, verdict.num_emitted)
    assert result.num_appended.tolist() == [2, 4, 0]
    assert a.output_token_ids == full[:3] and a.is_finished
    sched.check_integrity()
