"""StepPlan (host numpy, shared memory) -> this rank's forward inputs (device tensors).

The plan's arrays are read-only views into a ring slot that rank 0 will overwrite, so
everything is copied out here; nothing downstream keeps a reference to the plan.

One copy per step. Every plan array is packed, in wire order, into one flat int32 host buffer,
which travels to the device in ONE host-to-device copy; the inputs are views of the device
buffer (widened to int64 on the device where the model indexes with them):

    flat int32, each segment starting at a multiple of 4 elements (16 bytes)
    | input_ids[T] | positions[T] | slot_mapping[T] | query_start_loc[B+1] | seq_lens[B] |
    | block_table[B*W] | logits_indices[B'] |

`StepInputBuffers` owns those buffers for the runner's whole life, sized for the largest step
(T_max = max_num_batched_tokens, B_max = max_num_seqs, W_max = ceil(max_model_len /
block_size), B'_max = T_max + B_max: prompt-logprob rows follow the sampled rows). On CUDA:

    plan --pack--> pinned host[k] --H2D, non_blocking--> device buffer --> views
                        (k = 0, 1, 0, 1, ... per step; event[k] recorded after its copy)

An async copy reads pinned memory when the GPU gets to it, which may be after the host has
moved on: rank 0 packs step t+1 while the GPU still runs step t. Refilling the buffer that
copy is reading would hand the GPU half of the next step's inputs. So the host buffers
alternate, and packing into buffer k first waits on event[k], the end of the copy that last
read it (two steps ago, normally long done: the wait costs nothing unless the host is two
steps ahead). The device buffer needs no such care as long as every step runs on one stream
(the current one): the next step's copy into it is queued behind this step's kernels.

On CPU there is nothing asynchronous: one plain host buffer, and the "device" views are views
of it (the packing is the one copy out of shared memory). A plan larger than the buffers (a
hand-made one; the scheduler's never are) is staged in a one-off allocation instead.

Consequence for callers: the int32 views (query_start_loc, seq_lens, block_table) alias the
persistent buffer, so a step's inputs are valid until the next `prepare_inputs` with the same
buffers; nothing may keep them across steps.

Placeholder ids (asynchronous scheduling): `input_ids[i] < 0` stands for the token sampled from
logits row `-input_ids[i] - 1` of the previous RUN step, which rank 0 did not wait for. The
caller passes those tokens as `last_sampled` (a device tensor) and they are substituted on the
device, without a host sync; the host only checks, from the plan, that they exist.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

from rank_worker.attention.metadata import AttentionMetadata
from rank_worker.runner_config import RunnerConfig
from shm_ipc.step_plan import ARRAY_FIELDS, StepPlan

logger = logging.getLogger(__name__)


# Every segment starts on a 16-byte boundary (4 int32), as a separate allocation would: Triton
# specialises kernels on pointer alignment, and an odd offset would cost vectorised loads and a
# second compilation.
_ALIGN = 4


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _lengths(num_tokens: int, num_seqs: int, width: int, num_logits: int) -> list[int]:
    """Elements of each segment, in `ARRAY_FIELDS` order."""
    t, b = num_tokens, num_seqs
    return [t, t, t, b + 1, b, b * width, num_logits]


def packed_size(num_tokens: int, num_seqs: int, width: int, num_logits: int) -> int:
    """int32 elements of a packed plan with these counts, alignment padding included."""
    return sum(_aligned(n) for n in _lengths(num_tokens, num_seqs, width, num_logits))


def _plan_lengths(plan: StepPlan) -> list[int]:
    return _lengths(
        plan.num_tokens, plan.num_seqs, plan.block_table.shape[1], plan.logits_indices.shape[0]
    )


def _plan_size(plan: StepPlan) -> int:
    return sum(_aligned(n) for n in _plan_lengths(plan))


def _pack(plan: StepPlan, out: np.ndarray) -> int:
    """Copy the plan's arrays into `out` (int32) at aligned offsets; returns the elements used."""
    start = 0
    for name in ARRAY_FIELDS:
        arr = getattr(plan, name)
        out[start : start + arr.size] = arr.reshape(-1)
        start += _aligned(arr.size)
    return start


def _unpack(plan: StepPlan, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of a packed plan's segments in `flat`, by field name (block_table flat)."""
    parts, start = {}, 0
    for name, n in zip(ARRAY_FIELDS, _plan_lengths(plan), strict=True):
        parts[name] = flat[start : start + n]
        start += _aligned(n)
    return parts


@dataclass(frozen=True, eq=False)
class StepInputs:
    """One step's forward inputs on the device. Valid until the next `prepare_inputs` with the
    same buffers (views of persistent memory; see the module docstring)."""

    step_id: int  # for error messages downstream
    input_ids: torch.Tensor  # [T] int64, placeholders resolved
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata  # slot_mapping int64, the sequence layout int32
    logits_indices: torch.Tensor  # [B'] int64


class StepInputBuffers:
    """Persistent staging for one runner's step inputs (see the module docstring).

    Owned by one ModelRunner and used from its thread only, one step after another.
    """

    def __init__(
        self,
        *,
        max_num_tokens: int,
        max_num_seqs: int,
        max_block_table_width: int,
        device: torch.device | str,
    ) -> None:
        self.device = torch.device(device)
        self.capacity = packed_size(
            max_num_tokens, max_num_seqs, max_block_table_width, max_num_tokens + max_num_seqs
        )
        self.num_fallbacks = 0  # plans too large for the buffers, staged one-off
        self._is_cuda = self.device.type == "cuda"
        if self._is_cuda:
            self._host = [
                torch.empty(self.capacity, dtype=torch.int32, pin_memory=True) for _ in range(2)
            ]
            # copied[k]: recorded after the last H2D copy out of host[k]; never recorded = free.
            self._copied = [torch.cuda.Event() for _ in range(2)]
            self._device_buf = torch.empty(self.capacity, dtype=torch.int32, device=self.device)
        else:
            # Synchronous: one buffer, and it is also what the "device" views look at.
            self._host = [torch.empty(self.capacity, dtype=torch.int32)]
            self._copied = []
            self._device_buf = self._host[0]
        self._host_np = [h.numpy() for h in self._host]
        self._next = 0  # the host buffer the next step packs into

    @classmethod
    def for_config(cls, config: RunnerConfig, device: torch.device | str) -> StepInputBuffers:
        """Sized for the largest step the scheduler can send under `config`."""
        return cls(
            max_num_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_block_table_width=math.ceil(int(config.max_model_len) / config.block_size),
            device=device,
        )

    def fits(self, plan: StepPlan) -> bool:
        return _plan_size(plan) <= self.capacity

    def stage(self, plan: StepPlan) -> torch.Tensor:
        """The plan packed into a flat int32 device tensor `[n]` (module docstring layout)."""
        if not self.fits(plan):
            self.num_fallbacks += 1
            logger.debug(
                "step %d: plan of %d elements exceeds the %d-element input buffers; "
                "staging it in a one-off allocation",
                plan.step_id,
                _plan_size(plan),
                self.capacity,
            )
            return _stage_unbuffered(plan, self.device)
        k = self._next
        self._next = (k + 1) % len(self._host)
        if not self._is_cuda:
            n = _pack(plan, self._host_np[k])
            return self._device_buf[:n]
        # The copy that last read host[k] must be done before it is overwritten (see the
        # module docstring); a never-recorded event returns at once.
        self._copied[k].synchronize()
        n = _pack(plan, self._host_np[k])
        flat = self._device_buf[:n]
        flat.copy_(self._host[k][:n], non_blocking=True)
        self._copied[k].record(torch.cuda.current_stream(self.device))
        return flat


def _stage_unbuffered(plan: StepPlan, device: torch.device) -> torch.Tensor:
    """The allocation path: a fresh host buffer, copied synchronously where it must move."""
    host = np.empty(_plan_size(plan), dtype=np.int32)
    _pack(plan, host)
    return torch.from_numpy(host).to(device)


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


def prepare_inputs(
    plan: StepPlan,
    device: torch.device | str,
    *,
    buffers: StepInputBuffers | None = None,
    last_sampled: torch.Tensor | None = None,
) -> StepInputs:
    """Copy a plan to `device` (one host-to-device copy) and resolve placeholder ids.

    `buffers`: persistent staging (see the module docstring); None allocates per call.
    `last_sampled`: `[B'_prev]` int64 on `device`, the tokens sampled from the previous RUN
    step's logits rows; needed when the plan has placeholder ids (`input_ids[i] < 0` means row
    `-input_ids[i] - 1`). Raises ValueError naming the step when they are missing or too few.
    Token ids, positions, slots and logits rows become int64 (index tensors); the sequence
    layout stays int32, as attention kernels take it.
    """
    device = torch.device(device)
    if buffers is not None and buffers.device != device:
        raise ValueError(f"input buffers live on {buffers.device}, the inputs go to {device}")
    sampled = _placeholder_source(plan, last_sampled)
    flat = buffers.stage(plan) if buffers is not None else _stage_unbuffered(plan, device)
    parts = _unpack(plan, flat)
    input_ids = parts["input_ids"].to(torch.int64)  # [T], a copy: the views below alias flat
    if sampled is not None:
        # A gather on the device: the previous step's tokens never visit the host. Real ids
        # index row 0 (clamped), which exists since some placeholder refers to a row.
        rows = (-input_ids - 1).clamp_(min=0)  # [T]
        input_ids = torch.where(input_ids >= 0, input_ids, sampled.to(torch.int64)[rows])

    # Host copies of the layout: attention reads them on the host (no device sync).
    query_start_loc_host = np.array(plan.query_start_loc, dtype=np.int32)  # [B+1]
    seq_lens_host = np.array(plan.seq_lens, dtype=np.int32)  # [B]
    query_lens = np.diff(query_start_loc_host)
    meta = AttentionMetadata(
        slot_mapping=parts["slot_mapping"].to(torch.int64),  # [T]
        query_start_loc=parts["query_start_loc"],  # [B+1] int32
        seq_lens=parts["seq_lens"],  # [B] int32
        block_table=parts["block_table"].view(plan.block_table.shape),  # [B, W] int32
        max_query_len=int(query_lens.max()) if query_lens.size else 0,
        max_seq_len=int(seq_lens_host.max()) if seq_lens_host.size else 0,
        query_start_loc_host=query_start_loc_host,
        seq_lens_host=seq_lens_host,
    )
    return StepInputs(
        step_id=plan.step_id,
        input_ids=input_ids,
        positions=parts["positions"].to(torch.int64),  # [T]
        meta=meta,
        logits_indices=parts["logits_indices"].to(torch.int64),  # [B']
    )
