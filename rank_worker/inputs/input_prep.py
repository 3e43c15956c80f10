"""StepPlan (host numpy, shared memory) + this rank's block tables -> forward inputs (device).

The plan's arrays are read-only views into a ring slot that rank 0 will overwrite, so
everything is copied out here; nothing downstream keeps a reference to the plan. Per step:

1. the plan's block-table edits are replayed on the host mirror (`BlockTables.apply`);
2. everything the device needs is written straight into one flat host buffer: the plan's
   arrays, and positions and cache slots derived there with numpy from the plan's layout and
   the mirror (no Python loop over sequences or tokens). Index inputs are widened to int64 on
   the way, so that the device gets them ready to use (no conversion op per input per step):

    flat int32 elements, each segment starting at a multiple of 4 elements (16 bytes); an
    int64 segment takes two elements per value
    | input_ids[T] i64 | positions[T] i64 | slot_mapping[T] i64 | logits_indices[B'] i64 |
    | rows[B] i64 | query_start_loc[B+1] | seq_lens[B] | adapter_slots[T] |
    | edited cells[3 * N] (GPU only) |

3. the buffer travels in ONE host-to-device copy; the inputs are views of the device buffer,
   and on a GPU the same copy brings the edited (row, column, block id) cells, which are
   scattered into the device table; the step's block tables are then read out of it by row
   (`BlockTables.gather`).

The segments' offsets depend only on (T, B, B') (the cells come last), and a steady decode
batch keeps that shape step after step: the views of a shape are made once and reused (a torch
view costs microseconds, and a step takes eight of them).

`StepInputBuffers` owns those buffers for the runner's whole life, sized for the largest step
the scheduler sends (T_max = max_num_batched_tokens, B_max = max_num_seqs, B'_max =
max_num_logits_rows, N_max = the blocks a full token budget and one new block per sequence
take). On CUDA (double-buffered):

    write --> pinned host[k] --H2D, non_blocking--> device buffer --> views
                  (k = 0, 1, 0, 1, ... per step; event[k] marked after its copy)

An async copy reads pinned memory when the GPU gets to it, which may be after the host has
moved on: rank 0 prepares step t+1 while the GPU still runs step t. Refilling the buffer that
copy is reading would hand the GPU half of the next step's inputs. So the host buffers
alternate, and writing into buffer k first waits on event[k], the end of the copy that last
read it (two steps ago, normally long done: the wait costs nothing unless the host is two
steps ahead). The device buffer and table need no such care as long as every step runs on one
stream (the current one): the next step's copy and scatter are queued behind this step's
kernels.

On CPU there is nothing asynchronous: one plain host buffer, and the "device" views are views
of it (writing it is the one copy out of shared memory); the host table is the device table,
so no cells travel. `double_buffered=True` (with `BlockTables(device_copy=True)`; the runner's
`gpu_data_paths`) runs the GPU's layout on CPU tensors instead, so that CPU tests execute it;
the copies then go through a `rank_worker.inputs.copy_stream` stream, which tests replace with one that
checks the event protocol. A step larger than the buffers (a plan whose edits rewrite many long rows
at once, e.g. admissions with long cached prefixes) is staged in a one-off allocation instead.

Consequence for callers: every input is a view of the persistent buffers, so a step's inputs
are valid until the next `prepare_inputs` with the same buffers (on a GPU: in stream order, so
the kernels already queued read their own step's); nothing may keep them across steps.

Placeholder ids (asynchronous scheduling): `input_ids[i] < 0` stands for the token sampled from
logits row `-input_ids[i] - 1` of the previous RUN step, which rank 0 did not wait for. The
caller passes those tokens as `last_sampled` (a device tensor) and they are substituted on the
device, without a host sync; the host only checks, from the plan, that they exist.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from rank_worker.attention.metadata import AttentionMetadata
from rank_worker.inputs.block_tables import BlockTables
from rank_worker.inputs.copy_stream import CopyEvent, CopyStream, copy_stream_for
from rank_worker.runner_config import RunnerConfig
from shm_ipc.step_plan import StepPlan

logger = logging.getLogger(__name__)


# Every segment starts on a 16-byte boundary (4 int32), as a separate allocation would: Triton
# specialises kernels on pointer alignment, and an odd offset would cost vectorised loads and a
# second compilation. (It also keeps every int64 segment 8-byte aligned.)
_ALIGN = 4
# Segments in packing order, int64 ones (index inputs) first; the edited cells follow.
_I64_SEGMENTS = ("input_ids", "positions", "slot_mapping", "logits_indices", "rows")
_I32_SEGMENTS = ("query_start_loc", "seq_lens", "adapter_slots")
# Layouts whose views a buffer keeps (a decode batch uses one; prefill steps vary).
_MAX_CACHED_LAYOUTS = 8


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _Layout:
    """Where the segments of a step with T tokens, B sequences and B' logits rows lie in the
    flat int32 buffer (see the module docstring), and views of them."""

    def __init__(self, num_tokens: int, num_seqs: int, num_logits: int) -> None:
        t, b = num_tokens, num_seqs
        lengths = {
            "input_ids": t,
            "positions": t,
            "slot_mapping": t,
            "logits_indices": num_logits,
            "rows": b,
            "query_start_loc": b + 1,
            "seq_lens": b,
            "adapter_slots": t,
        }
        # name -> (first int32 element, number of values, int64?)
        self.segments: dict[str, tuple[int, int, bool]] = {}
        offset = 0
        for name in _I64_SEGMENTS:
            self.segments[name] = (offset, lengths[name], True)
            offset += _aligned(2 * lengths[name])
        for name in _I32_SEGMENTS:
            self.segments[name] = (offset, lengths[name], False)
            offset += _aligned(lengths[name])
        self.cells_offset = offset

    def size(self, num_cells: int) -> int:
        """int32 elements of the buffer with `num_cells` edited cells."""
        return self.cells_offset + _aligned(3 * num_cells)

    def numpy_views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        return {
            name: flat[o : o + 2 * n].view(np.int64) if wide else flat[o : o + n]
            for name, (o, n, wide) in self.segments.items()
        }

    def torch_views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            name: flat[o : o + 2 * n].view(torch.int64) if wide else flat[o : o + n]
            for name, (o, n, wide) in self.segments.items()
        }


def packed_size(num_tokens: int, num_seqs: int, num_logits: int, num_cells: int) -> int:
    """int32 elements of a step's segments, alignment padding included."""
    return _Layout(num_tokens, num_seqs, num_logits).size(num_cells)


@dataclass(frozen=True, eq=False)
class StepInputs:
    """One step's forward inputs on the device. Valid until the next `prepare_inputs` with the
    same buffers (views of persistent memory; see the module docstring)."""

    step_id: int  # for error messages downstream
    input_ids: torch.Tensor  # [T] int64, placeholders resolved
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata  # slot_mapping int64, the sequence layout int32
    logits_indices: torch.Tensor  # [B'] int64
    # [T] int32 LoRA slot of each token (-1: the base model), the plan's per-sequence slots
    # expanded; all -1 when the plan carries none. The runner copies it into the LoRA layers'
    # fixed buffer (`rank_worker.lora.layers.AdapterBatch`).
    adapter_slots: torch.Tensor


# Writes one step's segments into their host views (and its cells into the [3, N] view, if any).
Writer = Callable[[dict[str, np.ndarray], np.ndarray | None], None]
_Flat = TypeVar("_Flat", np.ndarray, torch.Tensor)


class StepInputBuffers:
    """Persistent staging for one runner's step inputs (see the module docstring).

    Owned by one ModelRunner and used from its thread only, one step after another.
    """

    def __init__(
        self,
        *,
        max_num_tokens: int,
        max_num_seqs: int,
        max_num_logits: int,
        max_edit_cells: int,
        device: torch.device | str,
        double_buffered: bool | None = None,
        stream: CopyStream | None = None,
    ) -> None:
        """`double_buffered`: the GPU's staging (two host buffers taking turns, a separate
        device buffer, each host buffer guarded by the event of its last copy); None = on for
        CUDA devices. On a CPU device it runs the same logic on CPU tensors (tests).
        `stream`: how the host buffers reach the device (`rank_worker.inputs.copy_stream`); None = the
        device's own."""
        self.device = torch.device(device)
        self.capacity = packed_size(max_num_tokens, max_num_seqs, max_num_logits, max_edit_cells)
        self.num_fallbacks = 0  # steps too large for the buffers, staged one-off
        is_cuda = self.device.type == "cuda"
        self.double_buffered = is_cuda if double_buffered is None else double_buffered
        self.stream = stream if stream is not None else copy_stream_for(self.device)
        if self.double_buffered:
            self._host = [
                torch.empty(self.capacity, dtype=torch.int32, pin_memory=is_cuda) for _ in range(2)
            ]
            self._device_buf = torch.empty(self.capacity, dtype=torch.int32, device=self.device)
        else:
            # Synchronous: one buffer, and it is also what the "device" views look at.
            self._host = [torch.empty(self.capacity, dtype=torch.int32)]
            self._device_buf = self._host[0]
        # copied[k]: the event of the last copy out of host[k]; None = no copy yet.
        self._copied: list[CopyEvent | None] = [None] * len(self._host)
        self._host_np = [h.numpy() for h in self._host]
        self._next = 0  # the host buffer the next step writes
        # (T, B, B') -> the layout, its numpy views of each host buffer, its device views.
        self._views: dict[
            tuple[int, int, int],
            tuple[_Layout, list[dict[str, np.ndarray]], dict[str, torch.Tensor]],
        ] = {}

    @classmethod
    def for_config(
        cls, config: RunnerConfig, device: torch.device | str, **kwargs: Any
    ) -> StepInputBuffers:
        """Sized for the largest step the scheduler sends under `config`; `kwargs` as for the
        constructor."""
        budget = config.max_num_batched_tokens
        return cls(
            max_num_tokens=budget,
            max_num_seqs=config.max_num_seqs,
            max_num_logits=config.resolved_max_num_logits_rows,
            # A step's new tokens fill at most this many new blocks, plus one block per
            # sequence where a chunk starts mid-block, plus the rows given up (empty edits).
            max_edit_cells=math.ceil(budget / config.block_size) + 2 * config.max_num_seqs,
            device=device,
            **kwargs,
        )

    def _views_of(
        self, key: tuple[int, int, int]
    ) -> tuple[_Layout, list[dict[str, np.ndarray]], dict[str, torch.Tensor]]:
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= _MAX_CACHED_LAYOUTS:
                del self._views[next(iter(self._views))]  # the oldest
            layout = _Layout(*key)
            views = (
                layout,
                [layout.numpy_views(h) for h in self._host_np],
                layout.torch_views(self._device_buf),
            )
            self._views[key] = views
        return views

    def stage(
        self, key: tuple[int, int, int], num_cells: int, write: Writer, step_id: int
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """Let `write` fill a step's segments (shape `key` = (T, B, B'), `num_cells` edited
        cells) in a host buffer, bring them to the device in one copy and return the device
        views and the `[3, num_cells]` cells (None without any; module docstring)."""
        layout, host_views, device_views = self._views_of(key)
        size = layout.size(num_cells)
        if size > self.capacity:
            self.num_fallbacks += 1
            logger.debug(
                "step %d: %d input elements exceed the %d-element input buffers; staging them "
                "in a one-off allocation",
                step_id,
                size,
                self.capacity,
            )
            return _stage_unbuffered(layout, num_cells, write, self.device)
        k = self._next
        self._next = (k + 1) % len(self._host)
        host_cells = _cells(self._host_np[k], layout, num_cells)
        copied = self._copied[k]
        if copied is not None:
            # The copy that last read host[k] must be done before it is overwritten (see the
            # module docstring); normally it finished two steps ago and this returns at once.
            copied.synchronize()
        write(host_views[k], host_cells)
        if self.double_buffered:
            self.stream.copy(self._device_buf[:size], self._host[k][:size])
            self._copied[k] = self.stream.mark()
        return device_views, _cells(self._device_buf, layout, num_cells)


def _cells(flat: _Flat, layout: _Layout, num_cells: int) -> _Flat | None:
    """The `[3, num_cells]` cells segment of `flat`; None without cells (most steps)."""
    if not num_cells:
        return None
    o = layout.cells_offset
    return flat[o : o + 3 * num_cells].reshape(3, num_cells)


def _stage_unbuffered(
    layout: _Layout, num_cells: int, write: Writer, device: torch.device
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The allocation path: a fresh host buffer, copied synchronously where it must move."""
    host = np.empty(layout.size(num_cells), dtype=np.int32)
    write(layout.numpy_views(host), _cells(host, layout, num_cells))
    flat = torch.from_numpy(host).to(device)
    return layout.torch_views(flat), _cells(flat, layout, num_cells)


def _placeholder_source(plan: StepPlan, last_sampled: torch.Tensor | None) -> torch.Tensor | None:
    """`last_sampled` if the plan holds placeholder ids, else None; raises if they cannot be
    resolved. A host scan of the plan: the device tensor is never read here."""
    if plan.num_tokens == 0:
        return None
    lowest = int(plan.input_ids.min())
    if lowest >= 0:
        return None
    if last_sampled is None:
        raise ValueError(
            f"step {plan.step_id}: input_ids hold placeholders for the previous step's sampled "
            "tokens, but no last_sampled tensor was given"
        )
    if last_sampled.ndim != 1:
        raise ValueError(
            f"step {plan.step_id}: last_sampled must be 1-D, got shape {tuple(last_sampled.shape)}"
        )
    row = -lowest - 1  # the largest row referenced
    if row >= last_sampled.shape[0]:
        raise ValueError(
            f"step {plan.step_id}: a placeholder refers to sampled row {row}, but last_sampled "
            f"holds {last_sampled.shape[0]} rows"
        )
    return last_sampled


def positions_of(plan: StepPlan) -> np.ndarray:
    """`[T]` int32 position of every new token: each sequence's are the last `q_len` of its
    `seq_len` (see AttentionMetadata)."""
    qsl = plan.query_start_loc
    q_lens = qsl[1:] - qsl[:-1]  # [B]
    first = plan.seq_lens - q_lens - qsl[:-1]  # [B] position minus token index
    return np.arange(plan.num_tokens, dtype=np.int32) + np.repeat(first, q_lens)


def write_adapter_slots(
    plan: StepPlan, q_lens: np.ndarray, decode_only: bool, out: np.ndarray
) -> None:
    """`out[T]` = each token's adapter slot: its sequence's (the plan's `adapter_slots`), or
    -1 everywhere when the plan has none (every sequence on the base model)."""
    slots = plan.section("adapter_slots")  # [B] or [0]
    if slots.size == 0:
        out.fill(-1)
    elif decode_only:
        out[...] = slots
    else:
        out[...] = np.repeat(slots, q_lens)


def prepare_inputs(
    plan: StepPlan,
    tables: BlockTables,
    *,
    buffers: StepInputBuffers | None = None,
    last_sampled: torch.Tensor | None = None,
    store_kv: bool = True,
) -> StepInputs:
    """Apply the plan's table edits and bring its inputs to the tables' device (one
    host-to-device copy), placeholder ids resolved.

    `store_kv` False: every slot is -1, so the step stores no K/V (warm-ups, which must leave
    the cache as it was).

    `buffers`: persistent staging (see the module docstring); None allocates per call.
    `last_sampled`: `[B'_prev]` int64 on the device, the tokens sampled from the previous RUN
    step's logits rows; needed when the plan has placeholder ids (`input_ids[i] < 0` means row
    `-input_ids[i] - 1`). Raises ValueError naming the step when they are missing or too few.
    Token ids, positions, slots and logits rows are int64 (index tensors); the sequence
    layout stays int32, as attention kernels take it.
    """
    device = tables.device
    if buffers is not None and buffers.device != device:
        raise ValueError(f"input buffers live on {buffers.device}, the inputs go to {device}")
    sampled = _placeholder_source(plan, last_sampled)
    cells = tables.apply(plan)  # [3, N]
    num_cells = cells.shape[1] if tables.has_device_copy else 0  # else nothing to send
    t, b = plan.num_tokens, plan.num_seqs
    qsl = plan.query_start_loc
    q_lens = qsl[1:] - qsl[:-1]  # [B]
    # A decode batch (one token each: T == B and no empty entry) needs no per-token layout.
    decode_only = 0 < b == t and np.count_nonzero(q_lens) == b

    def write(host: dict[str, np.ndarray], host_cells: np.ndarray | None) -> None:
        host["input_ids"][...] = plan.input_ids
        host["logits_indices"][...] = plan.logits_indices
        rows = host["rows"]  # [B] int64: numpy indexes with it as it is
        rows[...] = plan.rows
        host["query_start_loc"][...] = qsl
        host["seq_lens"][...] = plan.seq_lens
        positions = host["positions"]
        if decode_only:
            np.subtract(plan.seq_lens, 1, out=positions)
            token_rows = rows
        else:
            positions[...] = positions_of(plan)
            token_rows = np.repeat(rows, q_lens)
        if store_kv:
            tables.slots(token_rows, positions, out=host["slot_mapping"])
        else:
            host["slot_mapping"].fill(-1)
        write_adapter_slots(plan, q_lens, decode_only, host["adapter_slots"])
        if host_cells is not None:
            host_cells[...] = cells

    key = (t, b, int(plan.logits_indices.size))
    if buffers is not None:
        views, device_cells = buffers.stage(key, num_cells, write, plan.step_id)
    else:
        views, device_cells = _stage_unbuffered(_Layout(*key), num_cells, write, device)
    if device_cells is not None:
        tables.apply_on_device(device_cells)
    input_ids = views["input_ids"]  # [T]
    if sampled is not None:
        # A gather on the device: the previous step's tokens never visit the host. Real ids
        # index row 0 (clamped), which exists since some placeholder refers to a row.
        ids_rows = (-input_ids - 1).clamp_(min=0)  # [T]
        input_ids = torch.where(input_ids >= 0, input_ids, sampled.to(torch.int64)[ids_rows])

    # Host copies of the layout (attention reads them on the host: no device sync): the
    # plan's, copied out of the ring slot, which rank 0 will overwrite.
    query_start_loc_host = qsl.copy()  # [B+1]
    seq_lens_host = plan.seq_lens.copy()  # [B]
    max_seq_len = int(seq_lens_host.max()) if b else 0
    meta = AttentionMetadata(
        slot_mapping=views["slot_mapping"],  # [T] int64
        query_start_loc=views["query_start_loc"],  # [B+1] int32
        seq_lens=views["seq_lens"],  # [B] int32
        block_table=tables.gather(views["rows"], -(-max_seq_len // tables.block_size)),
        max_query_len=1 if decode_only else (int(q_lens.max()) if b else 0),
        max_seq_len=max_seq_len,
        query_start_loc_host=query_start_loc_host,
        seq_lens_host=seq_lens_host,
    )
    return StepInputs(
        step_id=plan.step_id,
        input_ids=input_ids,
        positions=views["positions"],  # [T] int64
        meta=meta,
        logits_indices=views["logits_indices"],  # [B'] int64
        adapter_slots=views["adapter_slots"],  # [T] int32
    )
