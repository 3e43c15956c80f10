"""Which CUDA graphs a rank runs, built and captured at start-up (and after a wake from sleep).

Graphs are off where `cuda_graphs.disabled_reason` says so (logged, with the reason); under
`TP_ENGINE_DECODE_GRAPHS=padded` on CPU the runners are built all the same and capture nothing
(their padded path runs eagerly: tests). Otherwise the mixed-step graphs
(`rank_worker.runner.mixed_graphs`), largest bucket first, then the decode and verify graphs
(`rank_worker.runner.cuda_graphs`) are captured into one memory pool: replays never overlap, so
the pool holds the largest graph's activations once and the smaller graphs reuse them. The
capture's seconds and the device memory it took are logged and returned.

Memory. The KV cache must exist before capture (a graph holds its addresses), so its sizing
(`rank_worker.kv.cache.measure_gpu_num_blocks`) cannot measure the graphs themselves. It
reserves what their pool will hold instead: the pool is the allocator's private one, apart from
the memory eager steps reuse, and grows to the working set of the largest graph's forward,
which `graph_pool_bytes` measures on an eager forward of as many tokens (no logits: they are
computed after the graph) over a scratch cache, after the warm-up. Not counted: each graph's
output rows beyond the largest's, and the driver's memory for the graphs themselves. After
capture the device's use is checked against `gpu_memory_utilization`, and a rank the graphs
pushed past it says by how much and what to lower (`over_budget_warning`).

Ownership: the runners returned belong to the calling `ModelRunner` (and hold its cache's
addresses); nothing here keeps them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rank_worker.attention.backend import AttentionBackend
from rank_worker.kv.device_memory import DeviceMemory, MemoryReading
from rank_worker.pp import PipelineInfo
from rank_worker.runner.cuda_graphs import (
    PADDED_NOTE,
    DecodeGraphRunner,
    disabled_reason,
    graph_runner_for,
    ladders,
    padded_without_capture,
    verify_query_lens,
)
from rank_worker.runner.mixed_graphs import MixedGraphRunner, mixed_runner_for
from rank_worker.runner_config import RunnerConfig
from rank_worker.tp import TPInfo

logger = logging.getLogger(__name__)


def captures_graphs(
    device: torch.device,
    config: RunnerConfig,
    backend: AttentionBackend,
    tp: TPInfo,
    pipe: PipelineInfo,
) -> bool:
    """Whether `build_graphs` will capture (the KV sizing then reserves the graphs' pool)."""
    return disabled_reason(device, config.enforce_eager, backend, tp, pipe) is None


def largest_graph_tokens(config: RunnerConfig) -> int:
    """Tokens of the largest graph captured: the largest mixed bucket, or the largest uniform
    batch (the memory pool grows to its forward's working set)."""
    uniform = ladders(
        verify_query_lens(config.num_speculative_tokens), config.max_num_seqs,
        config.max_num_batched_tokens, int(config.max_model_len),
    )  # fmt: skip
    most = max((q * sizes[-1] for q, sizes in uniform.items()), default=1)
    return max(most, config.resolved_cuda_graph_max_tokens)


def graph_pool_bytes(forward: Callable[[], object], memory: DeviceMemory) -> int:
    """The bytes `forward` (the model over `largest_graph_tokens`, its inputs and scratch cache
    already allocated) allocates at its peak above what was live before it."""
    memory.reset_peak()
    before = memory.read().allocated
    forward()
    return max(0, memory.read().peak_allocated - before)


@dataclass(frozen=True)
class GraphRunners:
    """What `build_graphs` made."""

    decode: DecodeGraphRunner
    mixed: MixedGraphRunner | None  # None: cuda_graph_max_tokens is 0
    # False on the padded test path: built, nothing captured.
    captured: bool
    # Device bytes the capture took (free memory before minus after: the pool and the graphs'
    # own driver memory); None when nothing was captured or the memory is not read.
    memory_bytes: int | None


def build_graphs(
    model: torch.nn.Module,
    kv_caches: list[Any],
    config: RunnerConfig,
    device: torch.device,
    backend: AttentionBackend,
    tp: TPInfo,
    pipe: PipelineInfo,
    set_lora: Callable[[bool], None] | None,
    memory: DeviceMemory | None,
    rank: int,
) -> GraphRunners | None:
    """This rank's graph runners, captured where graphs are on (a collective: every rank
    captures the same graphs in the same order); None where they are off. `rank`: for the log."""
    reason = disabled_reason(device, config.enforce_eager, backend, tp, pipe)
    # Tests: the graphs' padded path, uncaptured, where only the CPU device says no.
    padded = padded_without_capture(reason, device, config)
    if reason is not None:
        logger.info("rank %d: no CUDA graphs: %s%s", rank, reason, PADDED_NOTE if padded else "")
        if not padded:
            return None
    decode = graph_runner_for(model, kv_caches, config, device, set_lora)
    # A backend that loops over host lengths (torch) is never captured: CPU only.
    mixed = mixed_runner_for(
        model, kv_caches, config, device, set_lora, host_bounds=backend.supports_cuda_graphs
    )
    if padded:
        return GraphRunners(decode, mixed, captured=False, memory_bytes=None)
    runners = [decode] if mixed is None else [mixed, decode]  # the most tokens first
    seconds, memory_bytes = capture_all(runners, memory)
    logger.info(
        "rank %d: captured CUDA graphs in %.2f s, taking %s bytes of device memory "
        "(decodes: %s by tokens per sequence; mixed steps up to %s tokens: %s; larger steps "
        "and the rest run eagerly)",
        rank, seconds, memory_bytes, decode.ladders, None if mixed is None else mixed.buckets[-1],
        None if mixed is None else mixed.buckets,
    )  # fmt: skip
    if memory is not None and memory_bytes is not None:
        warning = over_budget_warning(memory.read(), config.gpu_memory_utilization, memory_bytes)
        if warning is not None:
            logger.warning("rank %d: %s", rank, warning)
    return GraphRunners(decode, mixed, captured=True, memory_bytes=memory_bytes)


def over_budget_warning(reading: MemoryReading, utilization: float, graph_bytes: int) -> str | None:
    """What to say when the device's use (every process's, as the sizing counts it) is past
    `utilization` of it once the graphs exist; None within it."""
    over = reading.total - reading.free - int(reading.total * utilization)
    if over <= 0:
        return None
    return (
        f"the device is {over} bytes past gpu_memory_utilization={utilization} after the CUDA "
        f"graphs took {graph_bytes} bytes, more than the KV-cache sizing reserved for them; "
        "lower --gpu-memory-utilization or --cuda-graph-max-tokens (or --enforce-eager)"
    )


def capture_all(runners: list[Any], memory: DeviceMemory | None) -> tuple[float, int | None]:
    """Capture each runner's graphs (`capture(pool)`) into one memory pool; the seconds it took
    and the device bytes it took (None without memory readings)."""
    before = memory.read() if memory is not None else None
    start = time.perf_counter()
    pool = torch.cuda.graph_pool_handle()
    for runner in runners:
        runner.capture(pool)
    seconds = time.perf_counter() - start
    if before is None or memory is None:
        return seconds, None
    return seconds, before.free - memory.read().free
