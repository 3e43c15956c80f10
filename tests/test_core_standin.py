"""The engine core driven by a stand-in executor: no model, no ranks, no `rank_worker`.

The stand-in "model" emits, for every logits row the plan asks for, the token
`next_token(input token of that row)`, so each request's output follows from its prompt alone
and a test can say exactly which tokens come out; every plan it receives is kept, so a test
can say exactly what the core sent (input ids, block-table edits). Block ids are exact: a fresh
pool hands out its empty blocks in id order (`tp_engine.core.kv.block_manager`).
"""

from __future__ import annotations

import subprocess
import sys
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tp_engine.config import EngineConfig
from tp_engine.core.engine_core import EngineCore
from tp_engine.core.sequence import SequenceStatus
from tp_engine.executor.base import StepResult
from tp_engine.sampling_params import SamplingParams

VOCAB = 32
EOS = 0
BLOCK = 4


def next_token(token: int) -> int:
    """The stand-in model's greedy choice after `token` (never EOS)."""
    return 1 + (token * 7) % (VOCAB - 1)


class StandInExecutor:
    """`tp_engine.executor.base.Executor` without a model (see the module docstring)."""

    def __init__(self, num_kv_blocks: int) -> None:
        self.device = torch.device("cpu")
        self.num_kv_blocks = num_kv_blocks
        self.num_host_blocks = 0
        self.plans: list = []
        self.closed_with: list[int | None] = []

    def execute(self, plan, sampled, timeline) -> StepResult:
        self.plans.append(plan)
        inputs = plan.input_ids[plan.logits_indices].astype(np.int64)
        # A placeholder `-1 - r` reads row r of the step in flight's samples (asynchronous
        # scheduling), as every rank does on the device.
        placeholders = inputs < 0
        if placeholders.any():
            assert sampled is not None, "a placeholder without a step in flight"
            inputs[placeholders] = sampled.cpu().numpy()[-1 - inputs[placeholders]]
        logits = torch.zeros(len(inputs), VOCAB)
        logits[torch.arange(len(inputs)), [next_token(int(t)) for t in inputs]] = 100.0
        return StepResult(logits)

    def control(self, call):
        raise AssertionError("the core makes no control call of its own")

    def guard(self, what: str):
        return nullcontext()

    def diagnose_stall(self, step_id: int):
        return None

    def check_ranks(self):
        return None

    def shutdown(self, exit_step_id: int | None) -> None:
        self.closed_with.append(exit_step_id)


def make_core(num_kv_blocks: int, **knobs) -> tuple[EngineCore, StandInExecutor]:
    config = EngineConfig(
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        block_size=BLOCK,
        num_kv_blocks=num_kv_blocks,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        **knobs,
    )
    executor = StandInExecutor(num_kv_blocks)
    spec = SimpleNamespace(is_pooling=False, task="generate")
    core = EngineCore(
        config, executor, tokenizer=None, vocab_size=VOCAB, eos_token_ids={EOS}, model_spec=spec
    )
    return core, executor


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def expected_output(prompt: list[int], n: int) -> list[int]:
    out, token = [], prompt[-1]
    for _ in range(n):
        token = next_token(token)
        out.append(token)
    return out


def step(core: EngineCore) -> dict[str, list[int]]:
    """One step: each sequence's new tokens; and the block manager's invariants hold."""
    outputs = core.step()
    core.scheduler.check_integrity()
    return {o.seq_id: list(o.new_token_ids) for o in outputs.outputs}


def test_prefill_decode_prefix_hit_abort_and_preemption_with_exact_blocks_and_tokens():
    core, executor = make_core(num_kv_blocks=5)
    bm = core.scheduler.block_manager
    a_prompt, a_out = [1, 2, 3, 4, 5, 6], expected_output([1, 2, 3, 4, 5, 6], 10)
    core.add_request("a", a_prompt, greedy(10))
    tokens: dict[str, list[int]] = {}

    def run_step() -> dict[str, list[int]]:
        out = step(core)
        for seq_id, new in out.items():
            tokens.setdefault(seq_id, []).extend(new)
        return out

    # Prefill: the whole prompt in one plan; blocks 0 and 1 (positions 0-3, 4-5).
    assert run_step() == {"a": a_out[:1]}
    a = core.scheduler.get("a")
    assert a.block_table == [0, 1]
    assert executor.plans[-1].input_ids.tolist() == a_prompt
    # Decode: one token, the last sampled one, at position 6, still in block 1.
    assert run_step() == {"a": a_out[1:2]}
    assert executor.plans[-1].input_ids.tolist() == a_out[:1]
    assert a.block_table == [0, 1]

    # A prefix hit: b's first block is a's full block 0 (tokens 1-4); it computes from 4.
    b_prompt = [1, 2, 3, 4, 9, 9]
    core.add_request("b", b_prompt, greedy(6))
    assert run_step() == {"a": a_out[2:3], "b": expected_output(b_prompt, 1)}
    b = core.scheduler.get("b")
    assert b.num_cached_tokens == 4
    assert b.block_table == [0, 2]  # shared block 0, a new block for positions 4-5
    assert bm.blocks[0].ref_cnt == 2
    # The plan carried a's decode token, then only b's uncomputed tail.
    assert executor.plans[-1].input_ids.tolist() == [a_out[1], 9, 9]

    # An abort frees b's own block and its reference to block 0; a keeps block 0.
    assert core.abort_request("b")
    assert core.scheduler.get("b") is None and b.status == SequenceStatus.FINISHED_ABORTED
    assert bm.blocks[0].ref_cnt == 1 and bm.blocks[2].ref_cnt == 0
    assert not core.abort_request("b")  # finished already
    # a at position 8 takes a new block: b's, empty again and first in the free queue.
    assert run_step() == {"a": a_out[3:4]}
    assert a.block_table == [0, 1, 2]

    # c takes the last two blocks; both decode while their blocks have room.
    c_prompt = [7] * 7
    c_out = expected_output(c_prompt, 3)
    core.add_request("c", c_prompt, greedy(3))
    assert run_step() == {"a": a_out[4:5], "c": c_out[:1]}  # a at 9, c's prompt 0-6
    c = core.scheduler.get("c")
    assert c.block_table == [3, 4] and bm.num_free_blocks == 0
    assert run_step() == {"a": a_out[5:6], "c": c_out[1:2]}  # a at 10, c at 7
    # Preemption: c at 8 needs a block and none is free; c, the most recently admitted, is
    # its own victim: back to waiting, its blocks given back (full ones stay cached).
    assert run_step() == {"a": a_out[6:7]}  # a at 11, still block 2
    assert core.scheduler.num_preemptions == 1
    assert c.status == SequenceStatus.WAITING and c.block_table == []
    assert a.block_table == [0, 1, 2] and bm.num_free_blocks == 2

    # Both finish, c recomputed from its prompt and its first two tokens, and nothing it
    # computed before the preemption is output twice.
    while core.has_unfinished():
        run_step()
    assert tokens == {"a": a_out, "b": expected_output(b_prompt, 1), "c": c_out}
    assert a.finish_reason == c.finish_reason == "length"
    assert bm.num_free_blocks == 5

    core.shutdown()
    assert executor.closed_with == [core.step_id]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_n_samples_and_asynchronous_scheduling_give_the_same_tokens(async_scheduling):
    # n = 2: the second sample waits until the first has computed the prompt, then finds its
    # full block in the prefix cache. Asynchronously, step() returns the previous step's
    # outputs and decodes read the step in flight's samples through placeholders.
    core, executor = make_core(num_kv_blocks=8, async_scheduling=async_scheduling)
    assert core.async_scheduling is async_scheduling
    prompt = [3, 1, 4, 1, 5, 9]
    params = SamplingParams(temperature=0.0, max_tokens=5, n=2)
    assert core.add_request("r", prompt, params) == ["0_r", "1_r"]
    core.add_request("s", [2, 7], greedy(4))
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished() or core.has_work():
        for seq_id, new in step(core).items():
            tokens.setdefault(seq_id, []).extend(new)
    expected = expected_output(prompt, 5)
    assert tokens == {"0_r": expected, "1_r": expected, "s": expected_output([2, 7], 4)}
    placeholders = [p for p in executor.plans if (p.input_ids < 0).any()]
    assert bool(placeholders) is async_scheduling
    assert core.scheduler.block_manager.prefix_cache_hits >= 1  # 1_r's first block
    core.shutdown()


def test_asynchronously_the_call_that_launches_a_prompts_last_chunk_returns_its_first_token():
    # Overlapped, a first token would come out only after the next step's launch; the step
    # that ends a prompt is applied by the call that launched it instead, as synchronously
    # (`tp_engine.core.pipeline`), and every other step still overlaps: the middle chunk of
    # b's prompt, and every decode.
    core, executor = make_core(num_kv_blocks=16, async_scheduling=True)
    a_prompt, b_prompt = [3, 1, 4, 1, 5], [1 + i % 30 for i in range(40)]
    a_out, b_out = expected_output(a_prompt, 6), expected_output(b_prompt, 2)
    core.add_request("a", a_prompt, greedy(6))
    calls = []
    for call in range(7):
        if call == 2:
            core.add_request("b", b_prompt, greedy(2))  # 40 tokens: two chunks of the 32 budget
        outputs = [(o.seq_id, list(o.new_token_ids)) for o in core.step().outputs]
        core.scheduler.check_integrity()
        last = executor.plans[-1]
        calls.append((outputs, len(executor.plans), bool((last.input_ids < 0).any())))
    # (outputs in order, plans sent so far, whether the latest plan reads the step in flight's
    # samples)
    expected = [
        ([("a", a_out[0:1])], 1, False),  # a's prompt: launched and applied
        ([], 2, False),  # a's decode, nothing in flight
        ([("a", a_out[1:2])], 3, True),  # a's decode + b's first chunk, overlapped
        # a's decode + b's last chunk, launched over b's middle one, then applied too
        ([("a", a_out[2:3]), ("a", a_out[3:4]), ("b", b_out[0:1])], 4, True),
        ([], 5, False),
        ([("a", a_out[4:5]), ("b", b_out[1:2])], 6, True),
        ([("a", a_out[5:6])], 6, True),
    ]
    assert calls == expected
    assert not core.has_unfinished() and not core.has_work()
    core.shutdown()


def test_asynchronously_a_prompt_only_request_ends_with_the_call_that_computes_its_prompt():
    # max_tokens=0 samples nothing; its end is its only output, and it goes out as a first
    # token does.
    core, executor = make_core(num_kv_blocks=16, async_scheduling=True)
    core.add_request("a", [3, 1, 4, 1, 5], greedy(4))
    for _ in range(2):  # a's prompt and first token, its first decode launched
        core.step()
    core.add_request("p", [2, 7, 1], greedy(0))
    outputs = core.step().outputs
    assert [(o.seq_id, o.finished) for o in outputs] == [("a", False), ("a", False), ("p", True)]
    assert len(executor.plans) == 3 and core.pipeline.in_flight is None
    core.shutdown()


def test_importing_the_core_loads_no_rank_worker_module():
    code = (
        "import sys; import tp_engine.core, tp_engine.core.engine_core, tp_engine.executor.base;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'rank_worker'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_core_is_composed_of_members_not_mixins():
    """The core, its scheduler and their members are plain classes (nothing of the project's
    own in their MRO); the engine holds a core rather than being one."""
    from tp_engine.core.block_allocation import BlockAllocation
    from tp_engine.core.intake import RequestIntake
    from tp_engine.core.pipeline import StepPipeline
    from tp_engine.core.plan_runner import PlanRunner
    from tp_engine.core.request_queue import RequestQueue
    from tp_engine.core.scheduler import Scheduler
    from tp_engine.core.scheduler_update import StepUpdater
    from tp_engine.core.step_planner import StepPlanner
    from tp_engine.core.verify_entries import VerifyPlanner
    from tp_engine.engine import LLMEngine

    owners = [EngineCore, RequestIntake, StepPipeline, PlanRunner, Scheduler, RequestQueue]
    owners += [BlockAllocation, VerifyPlanner, StepPlanner, StepUpdater, LLMEngine]
    for cls in owners:
        assert cls.__mro__ == (cls, object), cls.__mro__
    core, _ = make_core(num_kv_blocks=16)
    members = (core.intake, core.pipeline, core.plan_runner, core.scheduler)
    assert [type(m) for m in members] == [RequestIntake, StepPipeline, PlanRunner, Scheduler]
    sched = core.scheduler
    assert {type(m) for m in (sched.queue, sched.allocation, sched.verify, sched.planner)} == {
        RequestQueue,
        BlockAllocation,
        VerifyPlanner,
        StepPlanner,
    }
    # Both see the core's current scheduler, also after `reconfigure` builds a new one.
    core.reconfigure(max_num_seqs=2)
    assert core.intake.scheduler is core.pipeline.scheduler is core.scheduler is not sched
