"""Tiny factories and a checked step loop for the control-plane tests (no model, no CUDA)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from shm_ipc.step_plan import StepPlan
from tp_engine.block_manager import BlockManager
from tp_engine.config import EngineConfig
from tp_engine.plan_builder import build_step_plan
from tp_engine.sampling_params import SamplingParams
from tp_engine.scheduler import Scheduler, SchedulerOutput
from tp_engine.sequence import Sequence

EOS = 0


def make_scheduler(
    num_blocks: int = 8,
    block_size: int = 4,
    max_model_len: int = 64,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 32,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
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
    return Scheduler(config, bm, eos_token_ids=[EOS])


def make_seq(request_id: str, tokens: list[int], max_tokens: int | None = 4, **params) -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(max_tokens=max_tokens, **params))


def next_token(seq: Sequence) -> int:
    """A deterministic fake model: the next token depends only on the tokens so far, never 0."""
    return 1 + (sum(seq.token_ids) * 31 + seq.num_tokens) % 97


def reference_plan_arrays(out: SchedulerOutput, block_size: int) -> dict[str, np.ndarray]:
    """The StepPlan arrays computed one token at a time, the obvious way."""
    ids, pos, slots, qsl, lens, logits = [], [], [], [0], [], []
    for seq, n, samples in zip(out.scheduled, out.num_scheduled_tokens, out.samples, strict=True):
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // block_size] * block_size + p % block_size)
        qsl.append(qsl[-1] + n)
        lens.append(seq.num_computed_tokens + n)
        if samples:
            logits.append(qsl[-1] - 1)
    width = max((len(s.block_table) for s in out.scheduled), default=0)
    table = [s.block_table + [0] * (width - len(s.block_table)) for s in out.scheduled]
    as_i32 = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
    return {
        "input_ids": as_i32(ids),
        "positions": as_i32(pos),
        "slot_mapping": as_i32(slots),
        "query_start_loc": as_i32(qsl),
        "seq_lens": as_i32(lens),
        "block_table": as_i32(table).reshape(len(table), width),
        "logits_indices": as_i32(logits),
    }


def check_plan(plan: StepPlan, out: SchedulerOutput, block_size: int) -> None:
    plan.validate()
    for name, expected in reference_plan_arrays(out, block_size).items():
        np.testing.assert_array_equal(getattr(plan, name), expected, err_msg=name)


class Stepper:
    """Runs schedule -> plan -> fake sample -> update, checking every invariant after each step."""

    def __init__(self, sched: Scheduler, sample: Callable[[Sequence], int] = next_token) -> None:
        self.sched = sched
        self.sample = sample
        self.step_id = 0

    def step(self) -> tuple[SchedulerOutput, list[Sequence]]:
        out = self.sched.schedule()
        self.check()
        plan = build_step_plan(out, self.sched.block_manager.block_size, self.step_id)
        check_plan(plan, out, self.sched.block_manager.block_size)
        self.step_id += 1
        sampled = [self.sample(s) for s, smp in zip(out.scheduled, out.samples, strict=True) if smp]
        finished = self.sched.update(out, sampled)
        self.check()
        return out, finished

    def run_to_completion(self, max_steps: int = 10_000) -> list[Sequence]:
        done: list[Sequence] = []
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return done
            out, finished = self.step()
            assert not out.is_empty, "no progress while requests are unfinished (livelock)"
            done += finished
        raise AssertionError(f"not finished after {max_steps} steps")

    def check(self) -> None:
        self.sched.block_manager.check_integrity(self.sched.running)
        for seq in self.sched.waiting:
            assert seq.block_table == [] and seq.num_computed_tokens == 0, seq


def expected_output(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    """What the fake model generates for a prompt, computed without any scheduler."""
    seq = Sequence("ref", prompt)
    while seq.num_output_tokens < max_tokens and seq.num_tokens < max_model_len:
        token = next_token(seq)
        seq.append_token(token)
        if token == EOS:
            break
    return seq.output_token_ids
