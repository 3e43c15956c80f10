"""A decode server's requests whose prompt another server computes (prefill/decode
disaggregation): held outside the scheduler until their prompt's K/V has arrived.

Life of such a sequence (`tp_engine.server.rank0.disagg` drives it):

    hold ──blocks free──► reserve (its prompt's blocks taken; the prefill is told where they
      │                     │        are and writes them from its ranks)
      │                     ├──arrive(first token)──► the scheduler's waiting queue, with those
      │                     │     blocks and its prompt counted computed (`prompt_arrived`): its
      │                     │     admission computes only the prefill's first token
      │                     │     ... or the first token ends it (EOS, max_tokens 1): finished
      └─────────────────────┴──drop (failed, timed out, aborted)──► finished, blocks freed

A held sequence never holds the batch: the scheduler does not see it until it arrives (vLLM's
requests waiting for remote KV, SGLang's decode pre-allocation queue). Waiting for blocks is in
arrival order: a request whose prompt does not fit waits, and so do the ones behind it. The
prompt's tokens count as external prefix-cache hits (`KVTier.external_hits`, vLLM's
`external_prefix_cache_hits`) and as its cached tokens (`usage.prompt_tokens_details`).

Ownership: one `RemotePrompts` per `EngineCore`, given a getter of the current scheduler (a
`reconfigure` makes a new one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from tp_engine.core.sequence import Sequence, SequenceStatus, TokenLogprobs

if TYPE_CHECKING:
    from tp_engine.core.scheduler import Scheduler

__all__ = ["RemotePrompts"]


class RemotePrompts:
    """See the module docstring."""

    def __init__(self, scheduler: Callable[[], Scheduler], eos_token_ids: Iterable[int]) -> None:
        self._scheduler = scheduler
        self.eos_token_ids = frozenset(eos_token_ids)
        # Waiting for blocks, in arrival order; then holding them, waiting for the K/V.
        self._pending: dict[str, Sequence] = {}
        self._reserved: dict[str, Sequence] = {}

    def __len__(self) -> int:
        return len(self._pending) + len(self._reserved)

    def held(self) -> Iterator[Sequence]:
        yield from self._pending.values()
        yield from self._reserved.values()

    def reserved(self, seq_id: str) -> Sequence | None:
        """The held sequence `seq_id` once it has its blocks (None before, or if not held)."""
        return self._reserved.get(seq_id)

    def hold(self, seq: Sequence) -> None:
        """A new sequence whose prompt another server computes (checked to fit already)."""
        self._pending[seq.seq_id] = seq

    def reserve(self) -> list[Sequence]:
        """Give the waiting sequences their prompts' blocks, in order, while they fit; the ones
        that got them (their `block_table` says where the prefill must write)."""
        kv = self._scheduler().block_manager
        reserved = []
        for seq_id, seq in list(self._pending.items()):
            blocks = kv.take_blocks(kv.blocks_needed(seq.num_prompt_tokens))
            if blocks is None:
                break
            seq.block_table = blocks
            del self._pending[seq_id]
            self._reserved[seq_id] = seq
            reserved.append(seq)
        return reserved

    def arrive(self, seq_id: str, token: int, logprobs: TokenLogprobs | None) -> Sequence | None:
        """Its prompt's K/V is in its blocks and `token` is its first output: it joins the
        scheduler's queue, or ends here if that token ends it (then it is returned finished,
        its blocks freed). None if it is not held (aborted meanwhile)."""
        seq = self._reserved.pop(seq_id, None)
        if seq is None:
            return None
        scheduler = self._scheduler()
        kv = scheduler.block_manager
        seq.token_ids.append(token)
        if logprobs is not None and seq.sampling_params.logprobs is not None:
            seq.output_logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs.logprobs[0]
        prompt = seq.num_prompt_tokens
        seq.num_computed_tokens = prompt
        seq.num_cached_tokens = prompt
        kv.external_queries += prompt
        kv.external_hits += prompt
        status = self._first_token_ends(seq, token, scheduler.max_model_len)
        if status is not None:
            kv.free(seq)
            seq.status = status
            return seq
        seq.prompt_arrived = True
        scheduler.add(seq)
        return seq

    def drop(self, seq_id: str, status: SequenceStatus) -> Sequence | None:
        """End a held sequence (its K/V never came, or it was aborted): its blocks go back."""
        seq = self._pending.pop(seq_id, None) or self._reserved.pop(seq_id, None)
        if seq is None:
            return None
        if seq.block_table:
            self._scheduler().block_manager.free(seq)
        seq.status = status
        return seq

    def _first_token_ends(
        self, seq: Sequence, token: int, max_model_len: int
    ) -> SequenceStatus | None:
        """The stop checks of `scheduler_update.StepUpdater._stop` for the one token the
        prefill sampled (it ran them too: its answer ended there)."""
        params = seq.sampling_params
        past_min = params.min_tokens <= 1
        if past_min and not params.ignore_eos and token in self.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if past_min and token in params.stop_token_ids:
            seq.stop_reason = token
            return SequenceStatus.FINISHED_STOPPED
        if params.max_tokens == 1 or seq.num_tokens >= max_model_len:
            return SequenceStatus.FINISHED_LENGTH_CAPPED
        return None
