"""The GPU's KV-cache sizing and memory release, run on CPU.

`ModelRunner` measures the device through a `DeviceMemory` (`rank_worker.kv.device_memory`); a
stand-in here gives the readings a GPU would, so the runner's side of the measurement (the
baseline taken before the weights, the warm-up between the reset and the reading, its scratch
cache) runs in CI. Releasing an engine frees every tensor it made, which is what lets a second
engine in the process find the device as the first one did (the first native run failed
there). The `gpu` test builds three engines in a row on a real device.
"""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

from rank_worker.kv.cache import KVCacheSpec
from rank_worker.kv.device_memory import MemoryReading
from rank_worker.runner.model_runner import ModelRunner
from rank_worker.runner_config import RunnerConfig
from rank_worker.tp import TPInfo

TOTAL = 1 << 30
OUTSIDE = 100 << 20  # context and other processes
USER_TENSORS = 50 << 20  # alive in the process before the engine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    from tp_engine.testing import build_random_qwen3

    return str(
        build_random_qwen3(
            tmp_path_factory.mktemp("tiny"), hidden_size=32, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, intermediate_size=64, max_position_embeddings=64,
            seed=5,
        )
    )  # fmt: skip


class DeviceStandIn:
    """Readings of a device where this process held USER_TENSORS before the engine and the
    engine's warm-up peaks at `engine_peak` (weights, activations and the scratch cache)."""

    def __init__(self, engine_peak: int) -> None:
        self.engine_peak = engine_peak
        self.calls: list[str] = []

    def reset_peak(self) -> None:
        self.calls.append("reset_peak")

    def read(self) -> MemoryReading:
        self.calls.append("read")
        started = "reset_peak" in self.calls
        allocated = USER_TENSORS + (self.engine_peak if started else 0)
        return MemoryReading(
            total=TOTAL,
            free=TOTAL - OUTSIDE - allocated,
            reserved=allocated,
            allocated=allocated,
            peak_allocated=allocated,
        )


def test_runner_sizes_the_cache_from_its_own_use(checkpoint):
    config = RunnerConfig(
        max_model_len=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
        gpu_memory_utilization=0.5,
    )  # fmt: skip
    peak = 20 << 20
    memory = DeviceStandIn(engine_peak=peak)
    warmups = []
    runner = ModelRunner(checkpoint, config, TPInfo(0, 1), "cpu", memory=memory)
    original = runner._warmup
    runner._warmup = lambda *a: warmups.append(memory.calls[-1]) or original(*a)
    assert runner.baseline_allocated == USER_TENSORS  # read before the weights load
    blocks = runner.determine_num_kv_blocks()
    # The warm-up ran after the reset; the reading came after it.
    assert warmups == ["reset_peak"] and memory.calls[-1] == "read"
    spec = KVCacheSpec(2, 2, 16, 4, torch.float32)
    assert runner.kv_spec == spec
    # The warm-up's scratch cache: the longest prefill (32 tokens) in blocks of 4.
    scratch = math.ceil(32 / 4) * spec.bytes_per_block
    assert blocks == (int(TOTAL * 0.5) - (peak - scratch) - OUTSIDE) // spec.bytes_per_block
    runner.init_kv_cache(blocks)
    assert runner.kv_caches[0][0].shape[0] == blocks


def test_a_draft_models_cache_shares_the_measured_pool(checkpoint, tmp_path):
    """Speculative decoding with a draft model: a block of the pool holds both models' K/V, so
    the GPU sizing divides the budget (and the warm-up's scratch) by both caches' bytes, and
    both caches get the same block count."""
    from tp_engine.testing import truncate_layers

    draft = str(truncate_layers(checkpoint, tmp_path / "draft", 1))
    config = RunnerConfig(
        max_model_len=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
        gpu_memory_utilization=0.5, draft_model=draft,
    )  # fmt: skip
    peak = 20 << 20
    runner = ModelRunner(checkpoint, config, TPInfo(0, 1), "cpu", memory=DeviceStandIn(peak))
    blocks = runner.determine_num_kv_blocks()
    target, small = KVCacheSpec(2, 2, 16, 4, torch.float32), KVCacheSpec(1, 2, 16, 4, torch.float32)
    assert runner.draft is not None and runner.draft.kv_spec == small
    per_block = target.bytes_per_block + small.bytes_per_block
    scratch = math.ceil(32 / 4) * per_block
    assert blocks == (int(TOTAL * 0.5) - (peak - scratch) - OUTSIDE) // per_block
    runner.init_kv_cache(blocks)
    assert runner.kv_caches[0][0].shape[0] == runner.draft.kv_caches[0][0].shape[0] == blocks
    assert runner.draft.block_tables is runner.block_tables  # one mirror for both


def test_shutdown_frees_every_tensor_of_the_engine(checkpoint):
    """What a GPU gives back on shutdown is what the process stops referencing: weights, KV
    cache and staging buffers must all be unreachable once the LLM is shut down, even while the
    user still holds the LLM object (a notebook does)."""
    from tp_engine import LLM

    llm = LLM(checkpoint, num_kv_blocks=16, max_model_len=64, gpu_data_paths=True)
    llm.generate([[1, 2, 3]], use_tqdm=False)
    runner = llm.engine.runner
    tensors = [
        *runner.model.parameters(),
        runner.kv_caches[0][0],
        runner.input_buffers._device_buf,
        runner.block_tables.device_table,
    ]
    refs = [weakref.ref(t) for t in tensors]
    del tensors
    llm.shutdown()
    gc.collect()
    alive = [r for r in refs if r() is not None]
    assert not alive, f"{len(alive)} of {len(refs)} tensors outlive the engine"
    with pytest.raises(RuntimeError, match="after release"):
        from rank_worker.runner.model_runner import synthetic_plan

        runner.execute(synthetic_plan([(0, 1, [0])]))


@pytest.mark.gpu
def test_three_engines_in_a_row_gpu(checkpoint):
    """Each engine sizes the same cache, and after each the process's device memory is back to
    what it was before the first (weights, cache, graphs and workspaces all given back)."""
    from tp_engine import LLM

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    sizes, outputs = [], []
    for _ in range(3):
        llm = LLM(checkpoint, max_model_len=64, gpu_memory_utilization=0.5)
        sizes.append(llm.engine.num_kv_blocks)
        outputs.append(llm.generate([[1, 2, 3]], use_tqdm=False)[0].outputs[0].token_ids)
        llm.shutdown()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before
    assert sizes[0] == sizes[1] == sizes[2] and outputs[0] == outputs[1] == outputs[2]


def test_cublas_workspaces_go_back_with_the_last_runner(monkeypatch):
    """cuBLAS's workspaces (torch allocations that outlive an engine) are cleared when the last
    CUDA runner of the process is released, and never while another runner (whose graphs hold
    their addresses) lives. The CUDA calls are stand-ins; the bookkeeping is the GPU's."""
    from rank_worker.kv import device_memory

    cleared = []
    monkeypatch.setattr(device_memory, "_cuda_users", set())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch._C, "_cuda_clearCublasWorkspaces", lambda: cleared.append(1), raising=False
    )
    first, second = object(), object()
    device_memory.add_cuda_user(first)
    device_memory.add_cuda_user(second)
    device_memory.drop_cuda_user(first)
    assert cleared == []
    device_memory.drop_cuda_user(second)
    assert cleared == [1]
