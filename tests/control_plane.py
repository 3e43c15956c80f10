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


def reference_plan_arrays(
    out: SchedulerOutput, block_size: int, in_flight: SchedulerOutput | None = None
) -> dict[str, np.ndarray]:
    """The StepPlan arrays computed one token at a time, the obvious way.

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
    for seq, n, samples in zip(out.scheduled, out.num_scheduled_tokens, out.samples, strict=True):
        start = seq.num_computed_tokens + pending_tokens.get(id(seq), 0)
        for p in range(start, start + n):
            if p < seq.num_tokens:
                ids.append(seq.token_ids[p])
            else:
                assert p == seq.num_tokens and id(seq) in pending_rows, (seq, p)
                ids.append(-1 - pending_rows[id(seq)])
            pos.append(p)
            slots.append(seq.block_table[p // block_size] * block_size + p % block_size)
        qsl.append(qsl[-1] + n)
        lens.append(start + n)
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


def check_plan(
    plan: StepPlan, out: SchedulerOutput, block_size: int, in_flight: SchedulerOutput | None = None
) -> None:
    plan.validate()
    for name, expected in reference_plan_arrays(out, block_size, in_flight).items():
        np.testing.assert_array_equal(getattr(plan, name), expected, err_msg=name)


class Stepper:
    """Runs schedule -> plan -> fake sample -> update, checking every invariant after each step.

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
        # Asynchronous scheduling: the step scheduled last and its sampled tokens.
        self.in_flight: tuple[SchedulerOutput, list[int]] | None = None

    def has_work(self) -> bool:
        return self.sched.has_unfinished() or self.in_flight is not None

    def step(self) -> tuple[SchedulerOutput, list[Sequence]]:
        out = self.sched.schedule()
        self.check()
        plan = build_step_plan(out, self.sched.block_manager.block_size, self.step_id)
        in_flight = self.in_flight[0] if self.in_flight is not None else None
        check_plan(plan, out, self.sched.block_manager.block_size, in_flight)
        self.step_id += 1
        if self.async_scheduling:
            finished = self.sched.update(*self.in_flight) if self.in_flight is not None else []
            self.in_flight = None if out.is_empty else (out, self._sample(out))
        else:
            finished = self.sched.update(out, self._sample(out))
        self.check()
        return out, finished

    def _sample(self, out: SchedulerOutput) -> list[int]:
        return [self.sample(s) for s, smp in zip(out.scheduled, out.samples, strict=True) if smp]

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
        self.sched.block_manager.check_integrity(self.sched.running)
        for seq in self.sched.waiting:
            assert seq.block_table == [] and seq.num_computed_tokens == 0, seq
            assert seq.num_inflight_tokens == seq.num_placeholders == 0, seq
        for seq in self.sched.running:
            # At most the step in flight and the one just scheduled.
            assert 0 <= seq.num_placeholders <= 2, seq
            assert seq.num_computed_tokens + seq.num_inflight_tokens <= (
                seq.num_tokens + seq.num_placeholders
            ), seq


def expected_output(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    """What the fake model generates for a prompt, computed without any scheduler."""
    seq = Sequence("ref", prompt)
    while seq.num_output_tokens < max_tokens and seq.num_tokens < max_model_len:
        token = next_token(seq)
        seq.append_token(token)
        if token == EOS:
            break
    return seq.output_token_ids
