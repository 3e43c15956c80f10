"""Host <-> GPU copies that do not wait for the GPU (`tp_engine.common.transfers`)."""

from __future__ import annotations

import time

import pytest
import torch

from tp_engine.common.transfers import HostCopies, to_device_async
from tp_engine.core.sampling import LogprobsTensors


def test_on_cpu_every_helper_is_a_no_op():
    t = torch.arange(6)
    assert to_device_async(t, torch.device("cpu")) is t
    copies = HostCopies(torch.device("cpu"))
    assert copies.copy(t) is t
    lp = LogprobsTensors(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3), torch.ones(2))
    assert copies.copy_fields(lp).token_ids is lp.token_ids
    copies.record()
    copies.wait()


@pytest.mark.gpu
def test_host_copies_are_ready_before_later_gpu_work_finishes():
    device = torch.device("cuda")
    values = torch.arange(1000, device=device) * 3
    copies = HostCopies(device)
    host = copies.copy(values)
    lp = LogprobsTensors(values[:6].view(2, 3), values[:6].view(2, 3).float(), values[:2])
    host_lp = copies.copy_fields(lp)
    copies.record()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU work queued after the copies
    start = time.perf_counter()
    copies.wait()
    waited = time.perf_counter() - start
    assert host.device.type == "cpu" and host.is_pinned()
    assert torch.equal(host, torch.arange(1000) * 3)
    assert torch.equal(host_lp.logprobs, lp.logprobs.cpu())
    assert waited < 0.5, f"waited {waited:.2f} s: the wait covered the later GPU work"
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_to_device_async_copies_from_pinned_memory():
    host = torch.arange(10, dtype=torch.float32)
    on_gpu = to_device_async(host, torch.device("cuda"))
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), host)
