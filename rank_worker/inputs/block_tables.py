"""Every rank's mirror of rank 0's block tables, kept up to date by the plans' edits.

Rank 0's running batch gives each running sequence a row and keeps its block list there
(`tp_engine.core.running_batch`); a StepPlan carries only the edits since the last plan
(`shm_ipc.step_plan`). Each rank replays them, in order, on its own copy:

    host   [rows, max_blocks] int32   numpy; slot mappings are computed from it on the host
    device [rows, max_blocks] int32   on the GPU, edited by one scatter per step (the edits
                                      travel in the step's one host-to-device copy); attention
                                      reads a step's rows out of it on the device

so no rank ever copies whole tables per step, and a decode step's host work does not grow with
context length. On CPU the device table is the host table. The mirror is derived state: a rank
that replayed every plan holds exactly rank 0's tables (the control-plane tests check it after
every step).
"""

from __future__ import annotations

import numpy as np
import torch

from shm_ipc.step_plan import StepPlan


class BlockTables:
    """One rank's mirror (see the module docstring)."""

    def __init__(
        self,
        num_rows: int,
        max_blocks: int,
        block_size: int,
        device: torch.device | str,
        *,
        device_copy: bool | None = None,
    ) -> None:
        """`device_copy`: keep the device table as separate memory, edited by the plans' cells
        and read by a row gather, as on a GPU; None = only on CUDA devices. On a CPU device it
        runs the GPU's path on CPU tensors (tests: the kernels then see the GPU's strided
        block-table views)."""
        self.block_size = block_size
        self.device = torch.device(device)
        self.host = np.zeros((num_rows, max_blocks), dtype=np.int32)  # [R, W]
        self.lengths = np.zeros(num_rows, dtype=np.int32)  # [R] blocks held per row
        # Whether the device table is separate memory that `apply_on_device` must edit (else
        # it is the host table, edited by `apply` already).
        self.has_device_copy = self.device.type == "cuda" if device_copy is None else device_copy
        if self.has_device_copy:
            self.device_table = torch.zeros((num_rows, max_blocks), dtype=torch.int32,
                                            device=self.device)  # fmt: skip
        else:
            self.device_table = torch.from_numpy(self.host)  # the same memory

    @property
    def max_blocks(self) -> int:
        return int(self.host.shape[1])

    def apply(self, plan: StepPlan) -> np.ndarray:
        """Replay `plan`'s edits on the host table; returns them as `[3, N]` int32 (row, column,
        block id) cells, later edits winning, for `apply_on_device`."""
        edit_rows, starts, offsets = plan.edit_rows, plan.edit_starts, plan.edit_offsets
        if edit_rows.size == 0:
            return _NO_CELLS
        counts = offsets[1:] - offsets[:-1]  # [E]
        blocks = plan.edit_blocks  # [N]
        if blocks.size == edit_rows.size and np.count_nonzero(counts) == counts.size:
            # One block per edit (the decode path: rows growing by a block): cells as they are.
            rows, cols = edit_rows, starts
        else:
            rows = np.repeat(edit_rows, counts)  # [N]
            cols = np.repeat(starts - offsets[:-1], counts) + np.arange(blocks.size)  # [N]
        final = slice(None)
        if np.bincount(edit_rows).max() > 1:
            # A row edited twice (given up and taken again, or a new row that grew at once):
            # each cell's last write, each row's last length (edits apply in order).
            cells = rows.astype(np.int64) * self.max_blocks + cols
            _, last = np.unique(cells[::-1], return_index=True)
            keep = np.sort(cells.size - 1 - last)
            rows, cols, blocks = rows[keep], cols[keep], blocks[keep]
            _, last_edit = np.unique(edit_rows[::-1], return_index=True)
            final = edit_rows.size - 1 - last_edit
        if cols.size and int(cols.max()) >= self.max_blocks:
            raise ValueError(
                f"step {plan.step_id}: an edit writes block column {int(cols.max())} of a table "
                f"{self.max_blocks} wide"
            )
        self.host[rows, cols] = blocks
        self.lengths[edit_rows[final]] = starts[final] + counts[final]
        out = np.empty((3, rows.size), dtype=np.int32)
        out[0], out[1], out[2] = rows, cols, blocks
        return out

    def apply_on_device(self, cells: torch.Tensor) -> None:
        """Write `apply`'s `[3, N]` cells (now on the device) into the device table."""
        if self.has_device_copy and cells.shape[1]:
            rows, cols, blocks = cells.long()
            self.device_table[rows, cols] = blocks.to(torch.int32)

    def slots(
        self, rows: np.ndarray, positions: np.ndarray, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Cache slot of each token: `rows`, `positions` `[T]` -> `[T]` int64 (into `out`)."""
        bs = self.block_size
        block_index, offset = np.divmod(positions, bs)
        out = np.multiply(self.host[rows, block_index], bs, out=out, dtype=np.int64)
        out += offset
        return out

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """`[B, width]` int32 block tables of `rows` (an int64 device tensor), read on the
        device.

        With a device copy (GPU) whole rows are gathered and the result is a view with the full
        table's row stride: a few microseconds of device bandwidth, and the attention kernels
        see one stride for every step. Without one (CPU) only the `width` columns needed are
        copied, by numpy (from the same memory: a few times quicker than torch's index_select
        at this size).
        """
        if self.has_device_copy:
            return self.device_table.index_select(0, rows)[:, :width]
        return torch.from_numpy(self.host[rows.numpy(), :width])


# The cells of a plan that edits nothing (most decode steps); shared, hence read-only.
_NO_CELLS = np.zeros((3, 0), dtype=np.int32)
_NO_CELLS.flags.writeable = False
