"""One rank's model: its weight shard, its KV cache, and one forward pass per StepPlan.

Every rank (rank 0 included) owns a ModelRunner and calls `execute` with the same plan for
every step; the forward's collectives keep the ranks in lock-step, and the logits arrive on
rank 0 only. The runner holds no request state: what a step needs is in the plan, and what it
leaves behind is K/V in cache slots that rank 0's block manager accounts for.

Life cycle: construct (load weights) → `determine_num_kv_blocks()` (every rank, collective) →
`init_kv_cache(n)` with the agreed n → `execute(plan)` per step.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rank_worker.attention.backend import get_backend
from rank_worker.input_prep import prepare_inputs
from rank_worker.kv_cache import (
    KVCacheSpec,
    allocate_kv_cache,
    cpu_num_blocks,
    measure_gpu_num_blocks,
)
from rank_worker.loader import load_weights
from rank_worker.qwen3 import KVCachePair, Qwen3ForCausalLM
from rank_worker.runner_config import RunnerConfig
from rank_worker.sampler import sample
from rank_worker.tp import TPInfo, all_reduce_min_int
from shm_ipc.step_plan import Command, StepPlan

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def load_hf_config(model_dir: str | Path) -> Any:
    """The checkpoint's `config.json` as a transformers config object."""
    from transformers import AutoConfig  # deferred: transformers is slow to import

    return AutoConfig.from_pretrained(str(model_dir))


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


class ModelRunner:
    """This rank's shard of the model plus its KV cache (see the module docstring)."""

    def __init__(
        self,
        model_dir: str | Path,
        config: RunnerConfig,
        tp: TPInfo,
        device: torch.device | str,
        *,
        attention_backend: str = "torch",
    ) -> None:
        self.config = config
        self.tp = tp
        self.device = torch.device(device)
        torch.manual_seed(config.seed)
        self.hf_config = load_hf_config(model_dir)
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)
        self.model = Qwen3ForCausalLM(
            self.hf_config, tp, self.dtype, self.device, get_backend(attention_backend)
        )
        load_weights(self.model, model_dir)
        self.model.eval()
        self.kv_spec = KVCacheSpec.for_model(self.hf_config, tp, config.block_size, self.dtype)
        self.kv_caches: list[KVCachePair] | None = None
        self.num_kv_blocks: int | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    def determine_num_kv_blocks(self) -> int:
        """Blocks every rank can hold (collective: every rank must call it)."""
        if self.config.num_kv_blocks is not None:
            local = self.config.num_kv_blocks
        elif self.device.type == "cuda":
            local = measure_gpu_num_blocks(
                self.kv_spec, self._warmup, self.config.gpu_memory_utilization, self.device
            )
        else:
            local = cpu_num_blocks(
                self.kv_spec, self.config.num_kv_blocks, self.config.kv_cache_memory_bytes
            )
        return all_reduce_min_int(local, self.tp)

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the cache; `num_blocks` must be the same on every rank."""
        self.kv_caches = allocate_kv_cache(self.kv_spec, num_blocks, self.device)
        self.num_kv_blocks = num_blocks

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """One forward pass. Logits `[B', vocab]` fp32 on rank 0, None on the other ranks."""
        if plan.command != Command.RUN:
            raise ValueError(f"step {plan.step_id}: execute takes RUN plans, got {plan.command!r}")
        if self.kv_caches is None:
            raise RuntimeError("execute before init_kv_cache")
        return self._forward(plan, self.kv_caches)

    def _forward(self, plan: StepPlan, kv_caches: list[KVCachePair]) -> torch.Tensor | None:
        input_ids, positions, meta, logits_indices = prepare_inputs(plan, self.device)
        hidden = self.model(input_ids, positions, meta, kv_caches)  # [T, hidden]
        if logits_indices.numel() == 0:
            # A step of mid-prompt chunks only. Every rank sees the same plan, so all of them
            # skip the gather together.
            if not self.tp.is_first:
                return None
            return torch.empty((0, self.vocab_size), dtype=torch.float32, device=self.device)
        return self.model.compute_logits(hidden[logits_indices])  # [B', vocab] on rank 0

    # -- memory profiling (GPU) -----------------------------------------------------------

    def _warmup_plan(self) -> tuple[StepPlan, int]:
        """The largest step the scheduler can send, plus the blocks its scratch cache needs.

        One token budget's worth of tokens over `max_num_seqs` sequences: as few, as long
        prefills as max_model_len allows (attention's peak) and the rest single-token decodes,
        so that logits are computed for the most rows (the sampler's peak).
        """
        cfg = self.config
        max_model_len = int(cfg.max_model_len or 1)  # resolved: checked in __init__
        budget = cfg.max_num_batched_tokens
        num_seqs = min(cfg.max_num_seqs, budget)
        lens = [1] * num_seqs
        extra = budget - num_seqs
        for i in range(num_seqs):
            add = min(extra, max_model_len - 1)
            lens[i] += add
            extra -= add
        q_lens = np.array(lens, dtype=np.int32)  # [B]
        num_blocks = math.ceil(int(q_lens.max()) / cfg.block_size)
        starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)  # [B+1]
        num_tokens = int(starts[-1])
        plan = StepPlan(
            step_id=0,
            command=Command.RUN,
            input_ids=np.zeros(num_tokens, dtype=np.int32),
            positions=np.concatenate([np.arange(n, dtype=np.int32) for n in lens]),
            # Nothing is stored: every sequence reads the same scratch blocks.
            slot_mapping=np.full(num_tokens, -1, dtype=np.int32),
            query_start_loc=starts,
            seq_lens=q_lens,
            block_table=np.tile(np.arange(num_blocks, dtype=np.int32), (num_seqs, 1)),
            logits_indices=(starts[1:] - 1).astype(np.int32),
        )
        return plan, num_blocks

    @torch.inference_mode()
    def _warmup(self) -> int:
        """Run the largest step once; returns the bytes of scratch KV cache it allocated, which
        the sizing subtracts from the peak (the real cache replaces it)."""
        plan, num_blocks = self._warmup_plan()
        scratch = allocate_kv_cache(self.kv_spec, num_blocks, self.device)
        logits = self._forward(plan, scratch)
        if logits is not None:
            temps = torch.ones(logits.shape[0], device=self.device)
            sample(logits, temps)
        del scratch, logits
        return num_blocks * self.kv_spec.bytes_per_block
