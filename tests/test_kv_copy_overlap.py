"""Copies up from the host tier overlap the forward pass: the request waits, never the batch.

Rank 0 admits a sequence whose blocks come from below without computing it in that step
(`StepPlanner._admit`, `KVTier.loading`), unless nothing else would run; the ranks queue the
copies on a side stream and only the next plan's forward pass waits for them
(`HostBlockCopier.before_forward`). The deferred side stream runs copies as late as that
contract allows, so a forward pass reading a block before its copy lands would read stale K/V.
"""

from __future__ import annotations

import pytest
import torch

from rank_worker.kv.copies import HostBlockCopier
from rank_worker.kv.side_stream import (
    ENV_VAR,
    DeferredSideStream,
    ImmediateSideStream,
    side_stream_for,
)
from tests.control_plane import Stepper, make_scheduler, make_seq
from tp_engine.core.kv.blocks import LowerHit
from tp_engine.core.kv.host_tier import HostTier
from tp_engine.core.sequence import SequenceStatus


def cache(num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(num_blocks, 4, 2, 8, generator=g),
            torch.randn(num_blocks, 4, 2, 8, generator=g),
        )
        for _ in range(2)
    ]


H11 = [LowerHit(11, None, ())]  # a block as the device tier describes it (hash 11)


def test_copies_up_land_before_the_next_forward_pass_not_this_one() -> None:
    kv = cache(6)
    stream = DeferredSideStream()
    copier = HostBlockCopier(kv, num_host_blocks=4, stream=stream)
    tier = HostTier(4)
    block0 = [(k[0].clone(), v[0].clone()) for k, v in kv]
    # Down: the plan's forward pass may overwrite block 0, so it waits for the copy at once.
    copier.before_forward(tier.store(H11, [0]), reads_copies_up=False)
    assert stream.num_queued == 0
    for k, v in kv:
        k[0], v[0] = 0.0, 0.0
    # Up, overlapped: queued beside this forward pass, landed before the next one.
    copier.before_forward(tier.load(H11, [3]), reads_copies_up=False)
    assert stream.num_queued == 1 and not torch.equal(kv[0][0][3], block0[0][0])
    copier.before_forward([], reads_copies_up=False)  # the next plan
    assert stream.num_queued == 0
    for (k, v), (k0, v0) in zip(kv, block0, strict=True):
        assert torch.equal(k[3], k0) and torch.equal(v[3], v0)
    # Up, read by the plan that carries it (nothing else ran): waited for at once.
    copier.before_forward(tier.load(H11, [5]), reads_copies_up=True)
    assert stream.num_queued == 0 and torch.equal(kv[1][1][5], block0[1][1])


def test_the_side_stream_is_chosen_by_device_and_environment(monkeypatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert isinstance(side_stream_for(torch.device("cpu")), ImmediateSideStream)
    monkeypatch.setenv(ENV_VAR, "deferred")
    assert isinstance(side_stream_for(torch.device("cpu")), DeferredSideStream)
    monkeypatch.setenv(ENV_VAR, "later")
    with pytest.raises(ValueError, match="the only value is 'deferred'"):
        side_stream_for(torch.device("cpu"))


def evict_a_prompt(st: Stepper, prompt: list[int]) -> None:
    """Run `prompt` to completion, then a long one that evicts its cached blocks (down)."""
    for seq_id, tokens in (("first", prompt), ("evictor", list(range(100, 121)))):
        st.sched.add(make_seq(seq_id, tokens, max_tokens=1))
        st.run_to_completion()
    assert st.sched.block_manager.lower.num_cached_blocks >= 3


def batch(out) -> list[tuple[str, int]]:
    return [(s.seq_id, n) for s, n in zip(out.scheduled, out.num_scheduled_tokens, strict=True)]


def test_a_sequence_loading_from_below_computes_from_the_next_step() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, lower=HostTier(8))
    st = Stepper(sched)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks
    evict_a_prompt(st, prompt)
    other, again = make_seq("other", [7, 8, 9, 10, 11], max_tokens=2), make_seq("again", prompt)
    sched.add(other)
    sched.add(again)
    out, _ = st.step()
    # "again" holds its blocks (three being copied up) and a row, and computes nothing yet.
    assert batch(out) == [("other", 5)] and not out.step.reads_copies_up
    assert again.status == SequenceStatus.RUNNING and len(again.block_table) == 4
    assert sched.batch.num_computed[again.row] == 12
    out, _ = st.step()
    assert batch(out) == [("other", 1), ("again", 1)]  # its last prompt token, after the copies
    assert sched.block_manager.external_hits == 12


def test_with_nothing_else_to_run_it_computes_at_once_and_the_step_waits() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, lower=HostTier(8))
    st = Stepper(sched)
    prompt = list(range(1, 14))
    evict_a_prompt(st, prompt)
    sched.add(make_seq("again", prompt))
    out, _ = st.step()
    assert batch(out) == [("again", 1)] and out.step.reads_copies_up
