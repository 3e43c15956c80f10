"""What the KV-cache sizing reads of a device's memory, behind an interface a test can fake.

The sizing (`rank_worker.kv.cache.measure_gpu_num_blocks`) needs a handful of numbers: the
device's total and free bytes (every process), and this process's torch allocator: bytes
reserved, bytes in live tensors, and the peak of the latter since a reset. `CudaMemory` reads
them from torch.cuda; those few lines are all of the sizing that only a GPU runs. Tests drive
the same arithmetic on CPU with readings of their own (tests/test_memory_profile.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class MemoryReading:
    """One reading of a device's memory, in bytes."""

    total: int
    free: int  # device-wide: what no process holds
    reserved: int  # held by this process's torch allocator (live tensors and its cache)
    allocated: int  # in this process's live tensors
    peak_allocated: int  # the most `allocated` reached since the last `reset_peak`

    @property
    def outside_torch(self) -> int:
        """Held by anything but this process's torch allocator: the CUDA context, NCCL and
        cuBLAS workspaces, other processes (other ranks sharing the device included)."""
        return self.total - self.free - self.reserved


class DeviceMemory(Protocol):
    def read(self) -> MemoryReading:
        """The numbers once the device's queued work is done."""

    def reset_peak(self) -> None:
        """Return cached blocks to the device and start a new peak from what is live now."""


class CudaMemory:
    """`DeviceMemory` of one CUDA device, through torch.cuda (GPU only)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def read(self) -> MemoryReading:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return MemoryReading(
            total=total,
            free=free,
            reserved=torch.cuda.memory_reserved(self.device),
            allocated=torch.cuda.memory_allocated(self.device),
            peak_allocated=torch.cuda.max_memory_allocated(self.device),
        )

    def reset_peak(self) -> None:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)


# CUDA model runners of this process not yet released (by id), for `drop_cuda_user`.
_cuda_users: set[int] = set()


def add_cuda_user(owner: object) -> None:
    _cuda_users.add(id(owner))


def drop_cuda_user(owner: object) -> None:
    """`owner` gave its device memory back. When it was the process's last CUDA runner, cuBLAS's
    workspaces go back too: torch keeps one per (handle, stream) in its allocator, 32 MiB each
    on Hopper, so after an engine they stay allocated (seen on an H200: 32 MiB after an eager
    engine, 64 after one with graphs) and the process is not back where it started. Never while
    another runner lives: its captured graphs hold those workspaces' addresses."""
    _cuda_users.discard(id(owner))
    if _cuda_users or not torch.cuda.is_available():
        return
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
