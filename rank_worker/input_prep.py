"""StepPlan (host numpy, shared memory) -> this rank's forward inputs (device tensors).

The plan's arrays are read-only views into a ring slot that rank 0 will overwrite, so
everything is copied here; nothing downstream keeps a reference to the plan.
"""

from __future__ import annotations

import numpy as np
import torch

from rank_worker.attention.metadata import AttentionMetadata
from shm_ipc.step_plan import StepPlan

_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32}


def to_device(arr: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A plan array on `device` as `dtype` (int64 or int32), copied out of the plan."""
    # astype copies out of the read-only shared-memory view (and widens where asked).
    host = torch.from_numpy(arr.astype(_NUMPY_DTYPES[dtype]))
    return host.to(device)


def prepare_inputs(
    plan: StepPlan, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """Copy a plan to `device`: `(input_ids [T], positions [T], metadata, logits_indices [B'])`.

    Token ids, positions, slots and logits rows become int64 (index tensors); the sequence
    layout stays int32, as attention kernels take it.
    """
    device = torch.device(device)
    query_start_loc_host = np.array(plan.query_start_loc, dtype=np.int32)  # [B+1]
    seq_lens_host = np.array(plan.seq_lens, dtype=np.int32)  # [B]
    query_lens = np.diff(query_start_loc_host)
    meta = AttentionMetadata(
        slot_mapping=to_device(plan.slot_mapping, device, torch.int64),  # [T]
        query_start_loc=torch.from_numpy(query_start_loc_host).to(device),  # [B+1]
        seq_lens=torch.from_numpy(seq_lens_host).to(device),  # [B]
        block_table=to_device(plan.block_table, device, torch.int32),  # [B, W]
        max_query_len=int(query_lens.max()) if query_lens.size else 0,
        max_seq_len=int(seq_lens_host.max()) if seq_lens_host.size else 0,
        query_start_loc_host=query_start_loc_host,
        seq_lens_host=seq_lens_host,
    )
    input_ids = to_device(plan.input_ids, device, torch.int64)  # [T]
    positions = to_device(plan.positions, device, torch.int64)  # [T]
    logits_indices = to_device(plan.logits_indices, device, torch.int64)  # [B']
    return input_ids, positions, meta, logits_indices
