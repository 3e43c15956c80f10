"""What every logits processor is: `LogitsProcessor`, the per-row state of one kind of logits
change, with the row events and the step's edit; `Tensors`, host arrays to the sampling device
without a pageable copy; `DraftsAhead`, the drafts before each verified position, for the
processors that read the output. The package docstring says how the sampling builder drives
them and in which order they apply.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tp_engine.common.transfers import to_device_async
from tp_engine.core.sampling.edits import BanTokens, LogitsEdit
from tp_engine.core.sequence import Sequence


class Tensors:
    """Host arrays to tensors on the sampling device, without a pageable copy (one would wait
    for the forward pass that rank 0 overlaps with)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device

    def ints(self, values: list[int] | np.ndarray) -> torch.Tensor:
        return self.put(torch.as_tensor(np.asarray(values, dtype=np.int64)))

    def floats(self, values: list[float] | np.ndarray) -> torch.Tensor:
        return self.put(torch.as_tensor(np.asarray(values, dtype=np.float32)))

    def put_array(self, values: np.ndarray) -> torch.Tensor:
        return self.put(torch.from_numpy(np.ascontiguousarray(values)))

    def put(self, host: torch.Tensor) -> torch.Tensor:
        return to_device_async(host, self.device)


class LogitsProcessor(ABC):
    """Per-row state of one kind of logits change (see `tp_engine.core.sampling.processors`)."""

    # Whether a row's edit depends on its output tokens so far: then a speculative verify
    # entry's later positions need the drafts before them, which only a processor that takes
    # `DraftsAhead` in `edit` can do; the others' rows are not drafted (`blocks_drafts`).
    reads_output = True

    def __init__(self, tensors: Tensors) -> None:
        self.t = tensors
        self.vocab_size = tensors.vocab_size
        # Batch row -> this processor's state for the sequence in it (rows that ask only), and
        # the same as a mask over rows for the step's gather.
        self.state: dict[int, Any] = {}
        self._asks = np.zeros(0, dtype=bool)

    def reset(self, max_rows: int) -> None:
        self.state.clear()
        self._asks = np.zeros(max_rows, dtype=bool)

    def add_row(self, row: int, seq: Sequence) -> None:
        state = self.state_for(seq)
        if state is not None:
            self.state[row] = state
            self._asks[row] = True

    def remove_row(self, row: int) -> None:
        if self.state.pop(row, None) is not None:
            self._asks[row] = False

    def asks(self, rows: np.ndarray) -> np.ndarray:
        """[R] bool: which of batch `rows` have state here."""
        return self._asks[rows] if self.state else np.zeros(rows.size, dtype=bool)

    def blocks_drafts(self, rows: np.ndarray) -> np.ndarray:
        """[R] bool: which of batch `rows` this processor keeps from being drafted."""
        if not self.reads_output:
            return np.zeros(rows.size, dtype=bool)
        return self.asks(rows)

    def asking(self, rows: np.ndarray, live: np.ndarray) -> np.ndarray | None:
        """The positions among this step's sampled rows (the batch rows `rows`) that ask for
        this processor; None when none does. `live` False: the row's sequence stopped running
        since; nothing is applied to it."""
        if not self.state:
            return None
        positions = np.flatnonzero(self._asks[rows] & live)
        return positions if positions.size else None

    def edit(
        self,
        rows: np.ndarray,
        positions: np.ndarray,
        edited_index: np.ndarray,
        num_edited: int,
        ahead: DraftsAhead | None = None,
    ) -> LogitsEdit | None:
        """The edit of `positions` (from `asking`), addressed to the edited copy of the step's
        logits: position i is its row `edited_index[i]` of `num_edited`. `ahead`: the drafts
        before each sampled row of a speculative verify entry (only processors that read the
        output look at it; their rows are not drafted otherwise)."""
        states = [self.state[row] for row in rows[positions].tolist()]
        return self.make_edit(edited_index[positions], states, num_edited)

    @abstractmethod
    def state_for(self, seq: Sequence) -> Any | None:
        """This processor's state for `seq`, now taking a row; None if it does not ask."""

    @abstractmethod
    def make_edit(
        self, positions: np.ndarray, states: list[Any], num_rows: int
    ) -> LogitsEdit | None:
        """The edit for rows `positions` (of the edited copy's `num_rows`) with `states`."""

    def _ban(
        self, positions: Iterable[int], token_lists: Iterable[Iterable[int]]
    ) -> LogitsEdit | None:
        rows: list[int] = []
        ids: list[int] = []
        for pos, tokens in zip(positions, token_lists, strict=True):
            tokens = list(tokens)
            rows += [pos] * len(tokens)
            ids += tokens
        if not rows:
            return None
        return BanTokens(self.t.ints(rows), self.t.ints(ids))


@dataclass(frozen=True)
class DraftsAhead:
    """A step's sampled rows that verify drafts: row i samples `ahead[i]` positions past its
    sequence's next one, after the drafts `drafts[i][:ahead[i]]` (its entry's)."""

    ahead: np.ndarray
    drafts: list[np.ndarray | None]

    def before(self, i: int) -> list[int]:
        j = int(self.ahead[i])
        drafts = self.drafts[i]
        return [] if j == 0 or drafts is None else drafts[:j].tolist()
