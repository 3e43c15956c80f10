"""What a rank's ModelRunner needs to know, and nothing rank-0-only.

Rank 0 derives it from the engine configuration and sends it to the workers at start-up (msgpack
inside the bootstrap message), so every rank builds the same model and the same KV layout
whatever each was launched with. Scheduling knobs (prefix caching, chunked prefill) are rank
0's business and are not here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# LoRA's limits, RunnerConfig's to check (`rank_worker.lora` reads the config, not the
# other way round). The slot stacks' dtypes (`--lora-dtype`; "auto": the model's).
LORA_DTYPES = ("auto", "float16", "bfloat16", "float32")
# The largest mixed step captured when `cuda_graph_max_tokens` is not given (vLLM's default
# max_cudagraph_capture_size is 512 too).
DEFAULT_MIXED_GRAPH_TOKENS = 512
# vLLM's `MaxLoRARanks`.
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def check_lora_limits(
    max_loras: int, max_lora_rank: int, max_cpu_loras: int | None, lora_dtype: str = "auto"
) -> None:
    """The engine's LoRA limits, with vLLM's messages (`LoRAConfig`), and the slot stacks'
    dtype name, checked here so that a typo fails before any rank loads the checkpoint."""
    if lora_dtype not in LORA_DTYPES:
        raise ValueError(f"lora_dtype must be one of {list(LORA_DTYPES)}, got {lora_dtype!r}")
    if max_loras < 1:
        raise ValueError(f"max_loras ({max_loras}) must be >= 1")
    if max_lora_rank not in MAX_LORA_RANKS:
        raise ValueError(f"max_lora_rank ({max_lora_rank}) must be one of {list(MAX_LORA_RANKS)}")
    if max_cpu_loras is not None and max_cpu_loras < max_loras:
        raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")


@dataclass(frozen=True)
class RunnerConfig:
    # Longest sequence; sizes the widest block table and the warm-up step.
    max_model_len: int
    # Tokens per KV block; fixes the cache layout.
    block_size: int
    # Largest step the scheduler may send: the warm-up forward that measures memory uses it.
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # Most logits rows a step may ask for: its sampled rows plus the prompt-logprob rows the
    # scheduler lets in (rank 0 knows its rule: `tp_engine.executor.rank_config.max_logits_rows_per_step`).
    # The warm-up computes exactly this many. None: every token of the largest step.
    max_num_logits_rows: int | None = None
    # Most of those rows sampled in one step (one per sequence, more with speculative decoding:
    # one per verified position). None: max_num_seqs.
    max_num_sampled_rows: int | None = None
    # "auto", "float32", "float16" or "bfloat16".
    dtype: str = "auto"
    # Seeds torch on every rank.
    seed: int = 0
    # GPU sizing: fraction of the device's memory the engine may use.
    gpu_memory_utilization: float = 0.9
    # Fixed pool size, or bytes for the cache (CPU default 1 GiB) when memory is not measured.
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    # No CUDA graphs.
    enforce_eager: bool = False
    # The largest mixed step (prompt tokens beside decodes, or prompts alone) captured in a
    # CUDA graph, in tokens (vLLM's max_cudagraph_capture_size, SGLang's --cuda-graph-max-bs);
    # larger steps run eagerly. None: `DEFAULT_MIXED_GRAPH_TOKENS`, at most the token budget;
    # 0: no mixed-step graphs (`rank_worker.runner.mixed_graphs`).
    cuda_graph_max_tokens: int | None = None
    # "auto", "torch", "triton" or "flash_attn"; each rank resolves it for its device and dtype
    # (`rank_worker.attention.selection`).
    attention_backend: str = "auto"
    # The non-matmul ops of the layers (norms, q/k norm + rotary, SiLU·mul): "triton" (fused
    # kernels), "torch" (the reference), or "auto" = triton wherever the attention backend runs
    # the project's kernels (triton, flash_attn), else torch. Like the attention backend, the
    # Triton path runs on CPU only under TRITON_INTERPRET=1 (tests, op counts).
    layer_kernels: str = "auto"
    # KV cache storage: "auto" (the model dtype) or "fp8" (float8_e4m3fn, per-layer scales).
    kv_cache_dtype: str = "auto"
    # Mixture-of-experts models: whole experts per rank instead of a slice of every expert
    # (`rank_worker.models.layers.moe`); no effect on dense models.
    # Prefill/decode disaggregation (the server's --disaggregation-mode): what each rank's KV
    # agent needs (`rank_worker.kv.pd_agent`): "mode" (prefill, decode), "host" (this node's
    # address for the transfer engine), "endpoint" (rank 0's ZeroMQ address for the agents),
    # "ib_device", "host_staging" and "staging_tokens" (`--disaggregation-host-staging*`).
    # None: off.
    disaggregation: dict[str, str] | None = None
    enable_expert_parallel: bool = False
    # Run the GPU's data paths on a CPU device: a separate device block table read by a row
    # gather (strided views into the kernels), double-buffered input staging guarded by copy
    # events. For tests: CPU CI then executes what only a GPU would (no effect on a GPU, which
    # always takes them).
    gpu_data_paths: bool = False
    # Speculative decoding with a draft model: its checkpoint directory. Every rank loads it,
    # sharded as the target is, with a KV cache of its own on the same block ids (a block
    # costs both caches' bytes), written by every RUN plan and by DRAFT plans.
    draft_model: str | None = None
    # Speculative decoding with an EAGLE-3 head: its directory. Every rank loads all of it
    # (replicated, `rank_worker.spec.eagle3_head`), with a one-layer KV cache on the pool's block ids.
    eagle3_head: str | None = None
    # Speculative decoding, any method: drafts per sequence and step (k; 0: none). Verify steps
    # compute up to 1 + k tokens per sequence; the CUDA graphs capture that uniform shape
    # (`rank_worker.runner.cuda_graphs`).
    num_speculative_tokens: int = 0
    # Fields merged into the checkpoint's config.json before anything reads it (vLLM's
    # `--hf-overrides`: YaRN, `is_matryoshka`, a reranker's architecture).
    hf_overrides: dict[str, Any] | None = None
    # The output head, `rank_worker.models.model_spec.HeadSpec.to_dict()`, decided on rank 0 (it
    # needs the tokenizer); None: the LM head.
    head: dict[str, Any] | None = None
    # Multi-LoRA (`rank_worker.lora`): slot stacks for `max_loras` adapters of rank up to
    # `max_lora_rank` beside every q/k/v/o/gate/up/down projection, allocated before the KV
    # cache is sized; a host LRU of `max_cpu_loras` parsed adapters (None: max_loras) feeds
    # them. `lora_dtype` "auto" is the model's dtype. No effect unless `enable_lora`.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    # GiB of host memory per rank for the KV tier below the device cache (`rank_worker.kv.copies`); None:
    # none. Every rank sizes its pool from it and its own cache layout, alike on every rank.
    kv_offloading_size: float | None = None
    # The KV file tier's directory (`kv_files`), below the host pool; None: none.
    kv_offloading_dir: str | None = None
    # Pipeline parallelism (`rank_worker.pp`): stages of the model, each a tensor-parallel group
    # of world_size / pipeline_parallel_size ranks holding its share of the layers; and that
    # share, layers per stage (None: vLLM's even split). Rank 0 resolves the partition once
    # ($TP_ENGINE_PP_LAYER_PARTITION or the engine's field), so every rank splits alike.
    pipeline_parallel_size: int = 1
    pp_layer_partition: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.pp_layer_partition is not None:  # a list after the wire
            object.__setattr__(self, "pp_layer_partition", tuple(self.pp_layer_partition))
        if self.enable_lora:
            check_lora_limits(
                self.max_loras, self.max_lora_rank, self.max_cpu_loras, self.lora_dtype
            )

    @property
    def resolved_cuda_graph_max_tokens(self) -> int:
        """The largest mixed-step bucket, within the token budget (0: none)."""
        asked = self.cuda_graph_max_tokens
        return min(
            DEFAULT_MIXED_GRAPH_TOKENS if asked is None else asked, self.max_num_batched_tokens
        )

    @property
    def resolved_max_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    @property
    def resolved_max_num_logits_rows(self) -> int:
        """The logits rows the memory warm-up budgets for (see `max_num_logits_rows`)."""
        if self.max_num_logits_rows is None:
            return self.max_num_batched_tokens
        return self.max_num_logits_rows

    @property
    def resolved_max_num_sampled_rows(self) -> int:
        if self.max_num_sampled_rows is None:
            return self.max_num_seqs
        return self.max_num_sampled_rows

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunnerConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"RunnerConfig: unknown fields {sorted(unknown)}")
        return cls(**data)
