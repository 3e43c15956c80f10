"""Structured outputs in the core: requests wait off the scheduler until their grammar is
compiled, and constrained sequences' matchers follow their tokens.

A request with a structured-output constraint waits, off the scheduler, until its grammar is
compiled on a background thread (`tp_engine.features.structured.grammar`); the other requests keep
running meanwhile. One that is not compiled within `structured_outputs_timeout_s` ends, alone.
Each of its sequences then gets a matcher, which the step pipeline advances with the sequence's
new tokens (`follow`) and the sampling builder asks for the next step's token bitmask. With
asynchronous scheduling that stays exact: step t+1's mask is filled while sampling it, after
step t's tokens were applied, while step t+1's forward runs on the GPU.

Ownership: the core owns one `GrammarGate` (`EngineCore.grammar_gate`); the sequences it holds
are the core's, handed to the scheduler once compiled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import wait as wait_for_futures
from typing import Any

from tp_engine.common.thinking import ThinkTokens, turn_boundary_ids
from tp_engine.core.sequence import Sequence, SequenceStatus
from tp_engine.features.structured.grammar import GrammarCompiler, GrammarState, compile_verdict

logger = logging.getLogger(__name__)


class GrammarGate:
    """Requests waiting for their grammar, and the sequences with a matcher."""

    def __init__(self, compiler: GrammarCompiler, timeout_s: float, tokenizer: Any) -> None:
        self.compiler = compiler
        self.timeout_s = timeout_s
        self.tokenizer = tokenizer
        # The id of each request's first sequence -> the compilation and the request's
        # sequences, and when the compilation must be done by.
        self.compiling: dict[str, tuple[Future, list[Sequence]]] = {}
        self.deadlines: dict[str, float] = {}
        # Set by the server's engine loop: the verdict on each constraint, by the request's
        # first sequence id (None: compiled; else why not), until it takes them.
        self.verdicts: dict[str, str | None] | None = None
        # Sequences with a matcher that have not finished.
        self.constrained: set[Sequence] = set()
        self._turn_boundaries: tuple[int, ...] | None = None

    def submit(self, constraint: Any, seqs: list[Sequence]) -> None:
        first = seqs[0].seq_id
        self.compiling[first] = (self.compiler.submit(constraint), seqs)
        self.deadlines[first] = time.monotonic() + self.timeout_s

    def queued(self) -> Iterator[Sequence]:
        for _, seqs in self.compiling.values():
            yield from seqs

    def remove(self, seq_id: str, status: SequenceStatus, stop_reason: int | str | None) -> bool:
        """End a sequence still waiting for its grammar; False if none has that id."""
        for _, seqs in self.compiling.values():
            for seq in seqs:
                if seq.seq_id == seq_id:
                    seqs.remove(seq)
                    seq.status = status
                    seq.stop_reason = stop_reason
                    self.compiling = {k: v for k, v in self.compiling.items() if v[1]}
                    self.deadlines = {
                        k: d for k, d in self.deadlines.items() if k in self.compiling
                    }
                    return True
        return False

    def release(self, idle: bool) -> tuple[list[list[Sequence]], list[Sequence]]:
        """The requests whose grammar is compiled, each sequence with its matcher, and the
        sequences of requests whose compilation failed or is not done by its deadline (aborted
        here; reported in `verdicts` too). `idle`: nothing else to do, so wait a little for a
        compilation."""
        if idle:
            wait_for_futures([f for f, _ in self.compiling.values()], timeout=0.05,
                             return_when="FIRST_COMPLETED")  # fmt: skip
        admitted, failed = [], []
        for first_id, (future, seqs) in list(self.compiling.items()):
            settled, why = compile_verdict(future, self.deadlines[first_id], self.timeout_s)
            if not settled:
                continue
            del self.compiling[first_id]
            del self.deadlines[first_id]
            if self.verdicts is not None:
                self.verdicts[first_id] = why
            if why is not None:
                logger.error("request %r: %s", seqs[0].group_id or first_id, why)
                for seq in seqs:
                    seq.status = SequenceStatus.FINISHED_ABORTED
                failed += seqs
                continue
            for seq in seqs:
                seq.grammar = self._grammar_state(seq, future.result())
                self.constrained.add(seq)
            admitted.append(seqs)
        return admitted, failed

    def _grammar_state(self, seq: Sequence, compiled: object) -> GrammarState:
        """A matcher for `seq`; with the think token ids set, the constraint applies after the
        thinking, from where the prompt leaves it (`tp_engine.features.structured.grammar`)."""
        params = seq.sampling_params
        if params.think_end_token_id is None:
            return GrammarState(compiled)
        if self._turn_boundaries is None:
            self._turn_boundaries = turn_boundary_ids(self.tokenizer)
        think = ThinkTokens(
            -1 if params.think_start_token_id is None else params.think_start_token_id,
            params.think_end_token_id,
            self._turn_boundaries,
        )
        prompt_state = think.prompt_state(seq.token_ids[: seq.num_prompt_tokens])
        return GrammarState(
            compiled, params.think_start_token_id, params.think_end_token_id, prompt_state
        )

    def follow(self, abort: Callable[[str], object]) -> None:
        """Advance the matchers with the tokens just applied. A sequence whose token its
        matcher rejects (the mask makes that impossible for a sampled token) is aborted."""
        for seq in list(self.constrained):
            if seq.is_finished:
                self.constrained.discard(seq)
                continue
            assert seq.grammar is not None
            if not seq.grammar.advance(seq.token_ids, seq.num_prompt_tokens):
                logger.error("request %r: output token %d breaks its constraint; aborted",
                             seq.seq_id, seq.token_ids[-1])  # fmt: skip
                abort(seq.seq_id)
                self.constrained.discard(seq)
