"""Applying a step: the second half of the scheduler (see `tp_engine.core.scheduler`).

`update()` takes the sampled token of every sequence that finished its uncomputed tokens this
step, advances the token accounting, registers newly full blocks in the prefix cache and
finishes sequences on EOS, a stop token id, max_tokens or max_model_len; a verify entry keeps
the drafts it accepted. `discard()` undoes a scheduled step whose tokens will never be applied.

Ownership: one `StepUpdater` per `Scheduler`, over the running batch, the KV manager, the
request queue and the block allocation it is given (a finished sequence gives its row and
blocks back through `BlockAllocation.retire` and leaves the queue's table); it owns the stop
rule's EOS ids.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from tp_engine.core.block_allocation import BlockAllocation
from tp_engine.core.kv.base import KVTier
from tp_engine.core.request_queue import RequestQueue
from tp_engine.core.running_batch import RunningBatch
from tp_engine.core.scheduled_step import ScheduledStep, UpdateResult
from tp_engine.core.sequence import Sequence, SequenceStatus

__all__ = ["StepUpdater"]


class StepUpdater:
    """Applies steps and undoes discarded ones (see the module docstring)."""

    def __init__(
        self,
        batch: RunningBatch,
        kv: KVTier,
        queue: RequestQueue,
        alloc: BlockAllocation,
        eos_token_ids: Iterable[int],
    ) -> None:
        self.batch = batch
        self.kv = kv
        self.block_size = kv.block_size
        self.queue = queue
        self.alloc = alloc
        self.eos_token_ids = frozenset(eos_token_ids)
        self._eos_ids = sorted(self.eos_token_ids)

    def update(
        self,
        step: ScheduledStep,
        sampled_token_ids: np.ndarray,
        num_emitted: np.ndarray | None = None,
    ) -> UpdateResult:
        """Apply a finished step: the new tokens of each True in `step.samples`, in batch order,
        one each, or (speculative decoding) `num_emitted[i]` for sampled entry i, entry after
        entry. A verify entry that emits a tokens accepted a - 1 of its drafts: its other
        drafts are rolled back here (their K/V is not counted as computed, and blocks holding
        nothing but rejected positions go back to the pool)."""
        tokens = np.asarray(sampled_token_ids, dtype=np.int64)
        num_samples = step.num_samples
        if num_emitted is None:
            if tokens.shape != (num_samples,):
                raise ValueError(f"expected {num_samples} sampled tokens, got {tokens.shape[0]}")
        else:
            num_emitted = np.asarray(num_emitted, dtype=np.int32)
            if num_emitted.shape != (num_samples,) or tokens.size != int(num_emitted.sum()):
                raise ValueError(
                    f"expected token counts for {num_samples} sampled entries summing to the "
                    f"{tokens.size} tokens, got {num_emitted.shape}"
                )
            if np.count_nonzero(num_emitted < 1) or (
                step.num_drafts is not None
                and np.count_nonzero(num_emitted > step.num_drafts[step.samples] + 1)
            ):
                raise ValueError("each sampled entry emits 1 .. drafts + 1 tokens")
        b = self.batch
        rows, num = step.rows, step.num_scheduled
        # Tokens of each entry whose K/V stays: all but the rejected drafts.
        kept = num
        if num_emitted is not None and step.num_drafts is not None:
            kept = num.copy()
            kept[step.samples] -= step.num_drafts[step.samples] - (num_emitted - 1)
        sampled = rows if num_samples == rows.size else rows[step.samples]
        sampled_live = None  # [S] which sampled entries still run their sequence (None: all)
        # Rows still running the sequence they held when the step was scheduled; the others
        # were aborted, preempted or finished meanwhile, and their entries are discarded.
        if step.num_removals != b.num_removals:  # else no row has changed hands since
            live = b.live(rows, step.serials)
            if np.count_nonzero(live) < live.size:
                sampled_live = live[step.samples]
                sampled = sampled[sampled_live]
                if num_emitted is None:
                    tokens = tokens[sampled_live]
                else:
                    tokens = tokens[np.repeat(sampled_live, num_emitted)]
                    num_emitted = num_emitted[sampled_live]
                rows, num, kept = rows[live], num[live], kept[live]
        computed = b.num_computed[rows] + kept
        b.num_computed[rows] = computed
        b.num_inflight[rows] -= num
        # Accepted drafts are computed before they are known tokens: until they are appended,
        # only the known ones can go into the prefix cache.
        ahead = None
        if num_emitted is not None:
            known = b.num_tokens[rows]
            if np.count_nonzero(computed > known):
                ahead = rows[computed > known]
                computed = np.minimum(computed, known)
        self._commit_full_blocks(rows, computed, computed - kept)

        b.num_placeholders[sampled] -= 1
        seqs = list(map(b.seqs.__getitem__, sampled.tolist()))
        num_appended = np.zeros(num_samples, dtype=np.int32)
        if num_emitted is None or num_emitted.size == num_emitted.sum():
            finished = self._append(sampled, tokens)
            appended: np.ndarray | int = 1
        else:
            finished, appended = self._append_ragged(sampled, tokens, num_emitted)
        if sampled_live is None:
            num_appended[:] = appended
        else:
            num_appended[sampled_live] = appended
        if num_emitted is not None:
            self._release_unused_blocks(sampled[b.serial[sampled] != 0])
        if ahead is not None:
            ahead = ahead[b.serial[ahead] != 0]  # still running (a stop gives the row back)
            self._commit_full_blocks(
                ahead, np.minimum(b.num_computed[ahead], b.num_tokens[ahead]), before=None
            )
        # A prompt-only sequence ends once its prompt is computed (none usually run): "length"
        # (max_tokens 0), or "stop" for a pooling request, whose prompt is all it asked for.
        if b.num_prompt_only:
            prompt_done = rows[b.prompt_only[rows] & (computed >= b.num_tokens[rows])]
            for row in prompt_done.tolist():
                seq = b.seqs[row]
                assert seq is not None
                status = (
                    SequenceStatus.FINISHED_LENGTH_CAPPED
                    if seq.pooling_params is None
                    else SequenceStatus.FINISHED_STOPPED
                )
                finished.append(self._end(seq, status))
        return UpdateResult(seqs, finished, num_appended)  # type: ignore[arg-type]

    def _commit_full_blocks(
        self, rows: np.ndarray, computed: np.ndarray, before: np.ndarray | None
    ) -> None:
        """Register in the prefix cache the blocks of `rows` now full of computed K/V of known
        tokens (`computed` of them; `before`: as many before this step, to skip rows that
        crossed no block boundary, as most decodes; None: look at every row)."""
        if not self.kv.enable_prefix_caching or not rows.size:
            return
        bs = self.block_size
        if before is not None:
            crossed = (computed // bs > before // bs).nonzero()[0]
            rows, computed = rows[crossed], computed[crossed]
        if rows.size:
            self.kv.commit_computed_blocks_of(
                [self.batch.seqs[row] for row in rows.tolist()],
                computed.tolist(),
            )

    def _append(self, rows: np.ndarray, tokens: np.ndarray) -> list[Sequence]:
        """Append one token to each of `rows`; returns the sequences it stopped."""
        b = self.batch
        num_tokens = b.num_tokens[rows] + 1  # after this token
        b.num_tokens[rows] = num_tokens
        b.last_token[rows] = tokens
        for row, token in zip(rows.tolist(), tokens.tolist(), strict=True):
            b.seqs[row].token_ids.append(token)
        return self._stop(rows, tokens, num_tokens)

    def _append_ragged(
        self, rows: np.ndarray, tokens: np.ndarray, num_emitted: np.ndarray
    ) -> tuple[list[Sequence], np.ndarray]:
        """Append `num_emitted[i]` tokens to row i, one round per position, so that each token
        meets the stop checks as it would alone: a sequence stopped by its j-th token gets no
        more. Returns the sequences stopped and the tokens appended to each row."""
        b = self.batch
        serials = b.serial[rows]
        offsets = np.cumsum(num_emitted) - num_emitted
        finished: list[Sequence] = []
        appended = np.zeros(rows.size, dtype=np.int32)
        for j in range(int(num_emitted.max())):
            # Rows with a j-th token whose sequence is still running (a stop frees the row).
            going = (num_emitted > j) & (b.serial[rows] == serials)
            finished += self._append(rows[going], tokens[offsets[going] + j])
            appended += going
        return finished, appended

    def _release_unused_blocks(self, rows: np.ndarray) -> None:
        """Rows (running) that hold blocks past their known tokens, reserved for drafts that
        were rejected, give them back (the next step allocates what its drafts need)."""
        b = self.batch
        needed = -(-b.num_tokens[rows] // self.block_size)  # blocks for every known token
        surplus = b.num_blocks[rows] > needed
        for row, keep in zip(rows[surplus].tolist(), needed[surplus].tolist(), strict=True):
            self.kv.free_tail(b.seqs[row], keep)
            b.truncate_blocks(row, keep)

    def _stop(self, rows: np.ndarray, tokens: np.ndarray, num_tokens: np.ndarray) -> list[Sequence]:
        """End the sequences (at `rows`, `num_tokens` long now) whose new token stops them: EOS,
        a stop token id (both only past min_tokens), max_tokens or max_model_len.

        Vectorised down to the candidates (a length reached, an EOS id, or a row with stop
        token ids at all); min_tokens and the stop ids are checked in Python for those alone.
        """
        b = self.batch
        by_length = num_tokens >= b.length_end[rows]
        candidates = by_length
        # Rows with stop ids are looked at only if some row has them, EOS flags only if some
        # token is an EOS id.
        if b.num_with_stop_ids:
            candidates = candidates | b.has_stop_ids[rows]
        if self._eos_ids:
            is_eos = tokens == self._eos_ids[0]
            for eos_id in self._eos_ids[1:]:  # one or two ids: cheaper than np.isin
                is_eos |= tokens == eos_id
            if np.count_nonzero(is_eos):
                candidates = candidates | (is_eos & b.stops_on_eos[rows])
        finished = []
        for i in candidates.nonzero()[0].tolist():
            seq = b.seqs[int(rows[i])]
            assert seq is not None
            token = int(tokens[i])
            params = seq.sampling_params
            past_min = seq.num_output_tokens >= params.min_tokens
            if past_min and not params.ignore_eos and token in self.eos_token_ids:
                status = SequenceStatus.FINISHED_STOPPED
            elif past_min and token in params.stop_token_ids:
                seq.stop_reason = token
                status = SequenceStatus.FINISHED_STOPPED
            elif by_length[i]:
                status = SequenceStatus.FINISHED_LENGTH_CAPPED
            else:
                continue
            finished.append(self._end(seq, status))
        return finished

    def _end(self, seq: Sequence | None, status: SequenceStatus) -> Sequence:
        assert seq is not None
        self.alloc.retire(seq, finished=True)
        seq.status = status
        self.queue.forget(seq)
        return seq

    def discard(self, step: ScheduledStep) -> None:
        """Undo the in-flight accounting of a scheduled step whose tokens will never be applied
        (an exception, or Ctrl-C, between scheduling and update): its sequences compute those
        tokens again, and blocks reserved for its drafts are returned."""
        b = self.batch
        live = b.live(step.rows, step.serials)
        b.num_inflight[step.rows[live]] -= step.num_scheduled[live]
        b.num_placeholders[step.rows[step.samples & live]] -= 1
        if step.num_drafts is not None:
            # Blocks reserved for the drafts go back now, not at the row's next drafted step:
            # until then they would sit idle while others wait or get preempted for blocks.
            self._release_unused_blocks(step.rows[live & (step.num_drafts > 0)])
