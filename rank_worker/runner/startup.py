"""What a ModelRunner works out before it serves, apart from the runner itself: its dtypes, its
draft model's configuration, the warm-up plans (one launch of every Triton kernel; the largest
step, run once to profile memory) and the KV blocks this rank can hold.

Ownership: pure functions of the `RunnerConfig` (and, for the sizing, of the runner's memory
readings); the runner calls them and keeps the results (`rank_worker.runner.model_runner`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rank_worker.inputs.synthetic_plans import synthetic_plan
from rank_worker.kv.cache import CacheGroup, KVCacheSpec, cpu_num_blocks, measure_gpu_num_blocks
from rank_worker.kv.device_memory import DeviceMemory
from rank_worker.lora import layers as lora_layers
from rank_worker.models.layers.rope_spec import RopeSpec
from rank_worker.runner_config import RunnerConfig
from shm_ipc.step_plan import StepPlan

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Rank 0's sampler at its worst on `[rows, V]` warm-up logits, the first `num_sampled` of them
# sampled rows and the rest prompt-logprob rows.
ProfileSampling = Callable[[torch.Tensor, int], None]


def resolve_dtype(name: str, hf_config: Any, device: torch.device) -> torch.dtype:
    """`RunnerConfig.dtype` -> torch dtype. "auto": fp32 on CPU (CPU bf16 matmuls are slow and
    the CPU path is the exactness reference), the checkpoint's dtype on GPU."""
    if name != "auto":
        return getattr(torch, name)
    if device.type != "cuda":
        return torch.float32
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(ckpt, str):
        ckpt = getattr(torch, ckpt, None)
    # A config without a dtype says nothing about precision; fp32 cannot lose any.
    return ckpt if ckpt in _SUPPORTED_DTYPES else torch.float32


def check_max_model_len(config: RunnerConfig, hf_config: Any, model_dir: object) -> None:
    """Rank 0 checked max_model_len against the same spec (`EngineConfig.with_model_defaults`);
    a runner given more (a draft model with a shorter context) would read positions past its
    cos/sin table: garbage in the Triton kernels, not an error. ValueError then."""
    rope = RopeSpec.from_config(hf_config)
    if config.max_model_len is not None and config.max_model_len > rope.max_positions:
        raise ValueError(
            f"max_model_len ({config.max_model_len}) exceeds {model_dir}'s maximum length "
            f"{rope.max_positions} ({rope.max_positions_source})"
        )


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """`RunnerConfig.kv_cache_dtype` -> the cache's torch dtype ("auto": the model's)."""
    if name == "auto":
        return dtype
    if name == "fp8":
        return torch.float8_e4m3fn
    raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {name!r}")


def draft_config(config: RunnerConfig) -> RunnerConfig:
    """A draft model's runner config: the target's, without a draft, graphs, overrides, head or
    LoRA of its own. The draft proposes with the base model; verification keeps outputs exact."""
    return dataclasses.replace(
        config,
        draft_model=None,
        enforce_eager=True,
        hf_overrides=None,
        head=None,
        enable_lora=False,
    )


def kernel_warmup_plans(config: RunnerConfig, *, with_lora: bool) -> list[StepPlan]:
    """The smallest steps that launch every Triton kernel a step can launch.

    A decode over the longest context (the decode kernel, split in as many slices as a
    single sequence gets, and the merge of the slices) at the head of a mixed step with a
    2-token prefill after it (the prefill kernel on the rows after the decodes, as in a
    mixed step), plus the norms, q/k norm + rotary, K/V store and SiLU·mul of every layer.
    Nothing is stored (`store_kv=False`) and every read is of block 0, so the cache is
    untouched. Kernels are not specialised on what varies from step to step (batch size,
    table width, slice offsets), so these launches compile every binary serving needs.
    With LoRA, the mixed step runs the per-token LoRA kernels; a prefill long enough for
    the grouped ones follows (`rank_worker.lora.layers.GROUPED_MIN_TOKENS`).
    """
    max_model_len = int(config.max_model_len)
    width = math.ceil(max_model_len / config.block_size)
    decode = (max_model_len - 1, 1, [0] * width)  # (first position, new tokens, blocks)
    prefill = (0, min(2, config.max_num_batched_tokens), [0])
    mixed = config.max_num_seqs >= 2 and config.max_num_batched_tokens >= 3
    batches = [[decode, prefill]] if mixed else [[decode], [prefill]]
    if with_lora:
        n = min(lora_layers.GROUPED_MIN_TOKENS, config.max_num_batched_tokens, max_model_len)
        batches.append([(0, n, [0] * math.ceil(n / config.block_size))])
    return [synthetic_plan(seqs) for seqs in batches]


def largest_step_plan(config: RunnerConfig) -> tuple[StepPlan, int, int]:
    """The largest step the scheduler can send, plus the blocks its scratch cache needs.

    One token budget's worth of tokens over `max_num_seqs` sequences: as few, as long
    prefills as max_model_len allows (attention's peak) and the rest single-token decodes.
    Logits: one sampled row per sequence (the sampler's peak), then prompt-logprob rows up
    to `max_num_logits_rows`, the most a step may ask for, taken from the prefill tokens
    that are not a sequence's last, as a chunk asking for prompt logprobs has them. Every
    sequence reads the same scratch blocks; nothing is stored.
    """
    max_model_len = int(config.max_model_len or 1)  # resolved: ModelRunner.__init__ checked it
    budget = config.max_num_batched_tokens
    num_seqs = min(config.max_num_seqs, budget)
    lens = [1] * num_seqs
    extra = budget - num_seqs
    for i in range(num_seqs):
        add = min(extra, max_model_len - 1)
        lens[i] += add
        extra -= add
    num_blocks = math.ceil(max(lens) / config.block_size)
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)  # [B+1]
    num_tokens = int(starts[-1])
    sampled = starts[1:] - 1  # [B] each sequence's last token
    num_sampled = min(max(config.resolved_max_num_sampled_rows, num_seqs), num_tokens)
    num_rows = min(max(config.resolved_max_num_logits_rows, num_sampled), num_tokens)
    not_last = np.setdiff1d(np.arange(num_tokens, dtype=np.int32), sampled)
    # [B'] sampled rows first (with speculative decoding also rows of other positions, as
    # a verify entry has them), then prompt-logprob rows (the engine's order).
    logits = np.concatenate([sampled, not_last[: num_rows - num_seqs]]).astype(np.int32)
    blocks = list(range(num_blocks))
    plan = synthetic_plan([(0, n, blocks) for n in lens], logits)
    return plan, num_blocks, num_sampled


def local_num_kv_blocks(
    config: RunnerConfig,
    pool_spec: KVCacheSpec | CacheGroup,
    memory: DeviceMemory | None,
    baseline_allocated: int,
    ranks_on_device: int,
    warmup: Callable[[], int],
    graph_reserve: Callable[[], int] | None = None,
) -> int:
    """Blocks this rank can hold, before the ranks agree on the least: the configured number;
    else, where `memory` reads a GPU, what is left of the device after every rank's weights,
    `warmup`'s peak and `graph_reserve()` (the CUDA graphs' pool; None: no graphs) (the
    measurement counts other processes' memory as used), split between the ranks that share
    it; else (CPU) `kv_cache_memory_bytes`' worth."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if memory is not None:
        budget = config.gpu_memory_utilization
        blocks = measure_gpu_num_blocks(
            pool_spec, warmup, budget, memory, baseline_allocated, graph_reserve
        )
        return blocks // ranks_on_device
    return cpu_num_blocks(pool_spec, config.num_kv_blocks, config.kv_cache_memory_bytes)
