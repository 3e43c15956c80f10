"""Engine configuration: one frozen dataclass with vLLM's argument names.

`EngineConfig` is what the user asked for. Facts learnt at run time (the checkpoint's context
length, the measured number of KV blocks) never get written back into it: `with_model_defaults`
returns a new config, and the block count lives in the objects built from it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from tp_engine.config.speculative import SpeculativeConfig

DTYPES = ("auto", "float32", "float16", "bfloat16")
# The `attention_backend` values a user may give (the command lines offer these). Each rank
# checks its choice again, with its device and dtype in hand, in
# `rank_worker.attention.selection`, whose registry must list the same names (a test checks).
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")
# The KV cache's dtype, vLLM's `--kv-cache-dtype` names: "auto" = the model's dtype, "fp8" =
# float8_e4m3fn with per-layer scales (half the bytes of bf16).
KV_CACHE_DTYPES = ("auto", "fp8")
# The LoRA flags' values: the slot stacks' dtypes (`--lora-dtype`; "auto": the model's) and vLLM's
# `MaxLoRARanks` (`--max-lora-rank`). Every rank checks them again in
# `rank_worker.lora.peft_adapter`, whose tuples must be the same (a test checks); plain data
# here, so that the configuration imports no rank code.
LORA_DTYPES = ("auto", "float16", "bfloat16", "float32")
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# flash-attn 2's paged KV cache accepts only page sizes that are multiples of 256.
_FLASH_ATTN_BLOCK_MULTIPLE = 256
_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
# vLLM's --runner and --convert values (`rank_worker.models.model_spec` says what they decide).
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of the engine, named as in vLLM's `EngineArgs`."""

    # Checkpoint directory (config.json, *.safetensors, tokenizer files); None = the demo model.
    model: str | None = None
    # Directory of the tokenizer files (vLLM's --tokenizer); None = the checkpoint's own.
    tokenizer: str | None = None
    # Number of ranks that each hold a shard of every layer (of their pipeline stage).
    tensor_parallel_size: int = 1
    # Pipeline stages (vLLM's --pipeline-parallel-size): the layers split over this many groups
    # of tensor_parallel_size ranks each, world = TP x PP ranks (`rank_worker.pp`); one batch in
    # flight. Not yet with the features `_PP_REFUSED` names.
    pipeline_parallel_size: int = 1
    # Layers per pipeline stage, e.g. (3, 1); None = $TP_ENGINE_PP_LAYER_PARTITION ("3,1", like
    # vLLM's VLLM_PP_LAYER_PARTITION) when set, else vLLM's even split.
    pp_layer_partition: tuple[int, ...] | None = None
    # Longest sequence (prompt + output) served; None = the checkpoint's max_position_embeddings.
    max_model_len: int | None = None
    # Most sequences in one step.
    max_num_seqs: int = 256
    # Most new tokens in one step; None = max(max_model_len, 8192) without chunked prefill, else 8192.
    max_num_batched_tokens: int | None = None
    # Tokens per KV-cache block.
    block_size: int = 16
    # Reuse full KV blocks across requests that share a prefix.
    enable_prefix_caching: bool = True
    # Split long prompts into chunks that fit the token budget, batched with decodes.
    enable_chunked_prefill: bool = True
    # Fraction of GPU memory the engine may use (weights, activations and KV cache).
    gpu_memory_utilization: float = 0.9
    # Never capture CUDA graphs.
    enforce_eager: bool = False
    # The largest mixed step (prompt tokens, with or without decodes beside them) captured in a
    # CUDA graph, in tokens; larger ones run eagerly. None = 512 (at most the token budget);
    # 0 = no mixed-step graphs, decodes only (`RunnerConfig.cuda_graph_max_tokens`).
    cuda_graph_max_tokens: int | None = None
    # Parameter dtype; "auto" = the checkpoint's torch_dtype on GPU, float32 on CPU.
    dtype: str = "auto"
    # Seed of the random generators on every rank.
    seed: int = 0
    # Fix the size of the KV pool (blocks per rank) instead of measuring memory. Needed on CPU,
    # and by tests that force preemption with a tiny pool.
    num_kv_blocks: int | None = None
    # Bytes per rank for the KV cache when num_kv_blocks is not set and memory is not measured
    # (the CPU path); None = 1 GiB on CPU.
    kv_cache_memory_bytes: int | None = None
    # Paged-attention implementation: "torch", "triton", "flash_attn" (needs block_size a
    # multiple of 256), or "auto" = flash_attn where it can run, else triton on GPU, torch on CPU.
    attention_backend: str = "auto"
    # Schedule step t+1 while step t runs (vLLM's --async-scheduling): step t+1's decodes feed
    # the tokens step t samples straight from the device. None = on with a GPU, off on CPU,
    # where the forward pass runs on the calling thread and nothing can overlap.
    async_scheduling: bool | None = None
    # Mixture-of-experts models (Qwen3-MoE): place whole experts on ranks instead of a slice of
    # every expert on every rank (vLLM's --enable-expert-parallel). No effect on dense models.
    enable_expert_parallel: bool = False
    # KV cache storage: "auto" (the model dtype) or "fp8" (e4m3 with per-layer k/v scales, 1.0
    # unless the checkpoint gives them; twice the blocks in the same memory). Not with
    # flash_attn, whose paged cache is 16-bit.
    kv_cache_dtype: str = "auto"
    # Testing: take the GPU's data paths on CPU too (`RunnerConfig.gpu_data_paths`).
    gpu_data_paths: bool = False
    # Seconds a request's structured-output grammar may take to compile; a slower one ends
    # that request (the server answers it 400), the others run on.
    structured_outputs_timeout_s: float = 30.0
    # Speculative decoding (vLLM's `speculative_config`): a dict, its JSON, or a
    # SpeculativeConfig; None = off. See `tp_engine.features.speculative`.
    speculative_config: SpeculativeConfig | None = None
    # What the model is served as (vLLM's --runner / --convert, `rank_worker.models.model_spec`):
    # runner "auto" | "generate" | "pooling", convert "auto" | "none" | "embed" | "classify".
    # "auto" decides from the checkpoint (sentence-transformers files: an embedder; a
    # *ForSequenceClassification architecture: a classifier).
    runner: str = "auto"
    convert: str = "auto"
    # Fields merged into config.json (vLLM's --hf-overrides): a dict or its JSON, e.g.
    # {"is_matryoshka": true}, or a Qwen3-Reranker's {"architectures":
    # ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
    # "is_original_qwen3_reranker": true}.
    hf_overrides: dict[str, Any] | None = None
    # Multi-LoRA (vLLM's names; `tp_engine.features.lora.registry`): serve PEFT adapters, up to `max_loras`
    # distinct ones per batch (the device slots) of rank up to `max_lora_rank`, with
    # `max_cpu_loras` (None: max_loras) parsed adapters kept in host memory; `lora_dtype`
    # "auto" is the model's dtype.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    # A host-memory tier below the KV cache (vLLM's --kv-offloading-size): GiB of host memory
    # per rank holding that rank's KV shard of full blocks the GPU pool evicted, found again by
    # the prefix cache's hashes (`tp_engine.core.kv.host_tier`). None: no tier below.
    kv_offloading_size: float | None = None
    # A file tier below the host tier (`tp_engine.core.kv.file_tier`): a directory of block
    # files, written through from host memory and capped at `kv_offloading_dir_size` GiB (every
    # rank's files), that a restarted server on the same checkpoint reads again. None: none.
    kv_offloading_dir: str | None = None
    kv_offloading_dir_size: float = 16.0
    # Prefill/decode disaggregation, set by the server's rank 0 (`--disaggregation-mode`,
    # `tp_engine.server.rank0.disagg`) for every rank's KV agent (`RunnerConfig.disaggregation`).
    # None: off (the only value `LLM` takes).
    disaggregation: dict[str, str] | None = None

    def __post_init__(self) -> None:
        spec = SpeculativeConfig.parse(self.speculative_config)  # type: ignore[arg-type]
        object.__setattr__(self, "speculative_config", spec)
        object.__setattr__(self, "hf_overrides", parse_hf_overrides(self.hf_overrides))
        _check(self.runner in RUNNERS, "runner", f"must be one of {RUNNERS}, got {self.runner!r}")
        _check(
            self.convert in CONVERTS, "convert", f"must be one of {CONVERTS}, got {self.convert!r}"
        )
        if spec is not None:
            _check(
                not self.async_scheduling,
                "async_scheduling",
                "cannot be on with speculative decoding: the next step's drafts and inputs "
                "depend on the tokens this step accepts; leave it unset or set it False",
            )
        _check(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        _check(self.pipeline_parallel_size >= 1, "pipeline_parallel_size", "must be >= 1")
        if self.pp_layer_partition is not None:
            object.__setattr__(self, "pp_layer_partition", parse_partition(self.pp_layer_partition))
        if self.pipeline_parallel_size > 1:
            for what, field, is_on in _PP_REFUSED:
                _check(
                    not is_on(self),
                    field,
                    f"({what}) is not supported with pipeline_parallel_size="
                    f"{self.pipeline_parallel_size} yet",
                )
        # (The ranks check max_lora_rank against vLLM's choices: `RunnerConfig`.)
        _check(self.max_loras >= 1, "max_loras", "must be >= 1")
        if self.kv_offloading_size is not None:
            _check(self.kv_offloading_size > 0, "kv_offloading_size", "must be > 0 (GiB)")
        if self.kv_offloading_dir is not None:
            _check(
                self.kv_offloading_size is not None,
                "kv_offloading_dir",
                "needs kv_offloading_size too (the file tier is written from host memory)",
            )
        _check(self.kv_offloading_dir_size > 0, "kv_offloading_dir_size", "must be > 0 (GiB)")
        _check(self.max_lora_rank >= 1, "max_lora_rank", "must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        if self.max_model_len is not None:
            _check(self.max_model_len >= 1, "max_model_len", "must be >= 1")
        _check(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _check(
            self.block_size >= 1 and (self.block_size & (self.block_size - 1)) == 0,
            "block_size",
            f"must be a power of two, got {self.block_size}",
        )
        _check(
            0.0 < self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            f"must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _check(self.structured_outputs_timeout_s > 0, "structured_outputs_timeout_s", "must be > 0")
        _check(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _check(
            self.attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            f"must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}",
        )
        _check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
        )
        _check(
            not (self.kv_cache_dtype == "fp8" and self.attention_backend == "flash_attn"),
            "kv_cache_dtype",
            "'fp8' cannot be read by attention_backend 'flash_attn' (flash-attn 2's paged cache "
            "is fp16/bf16); use 'triton' or 'auto'",
        )
        if self.attention_backend == "flash_attn":
            _check(
                self.block_size % _FLASH_ATTN_BLOCK_MULTIPLE == 0,
                "attention_backend",
                f"'flash_attn' needs a block_size that is a multiple of "
                f"{_FLASH_ATTN_BLOCK_MULTIPLE} (its paged KV cache accepts no other), got "
                f"block_size={self.block_size}",
            )
        if self.cuda_graph_max_tokens is not None:
            _check(
                self.cuda_graph_max_tokens == 0 or self.cuda_graph_max_tokens >= 2,
                "cuda_graph_max_tokens",
                f"must be 0 (no mixed-step graphs) or >= 2, got {self.cuda_graph_max_tokens}",
            )
        if self.num_kv_blocks is not None:
            _check(self.num_kv_blocks >= 1, "num_kv_blocks", "must be >= 1")
        if self.kv_cache_memory_bytes is not None:
            _check(self.kv_cache_memory_bytes >= 1, "kv_cache_memory_bytes", "must be >= 1")
        if self.max_num_batched_tokens is not None:
            _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
            _check(
                self.max_num_batched_tokens >= self.max_num_seqs,
                "max_num_batched_tokens",
                f"({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs}) "
                "so that every running sequence can decode in one step",
            )
            if not self.enable_chunked_prefill and self.max_model_len is not None:
                _check(
                    self.max_num_batched_tokens >= self.max_model_len,
                    "max_num_batched_tokens",
                    f"({self.max_num_batched_tokens}) is smaller than max_model_len "
                    f"({self.max_model_len}); without chunked prefill a full-length prompt could "
                    "never be scheduled. Enable chunked prefill or raise max_num_batched_tokens",
                )

    @property
    def world_size(self) -> int:
        """Every rank of the engine: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def resolved_max_num_batched_tokens(self) -> int:
        """The step's token budget once max_model_len is known."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        budget = max(_DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs)
        if not self.enable_chunked_prefill and self.max_model_len is not None:
            budget = max(budget, self.max_model_len)
        return budget

    @property
    def max_blocks_per_seq(self) -> int:
        """Widest block table any sequence can need (for CUDA-graph buffers)."""
        if self.max_model_len is None:
            raise ValueError("max_model_len is not resolved yet; call with_model_defaults first")
        return math.ceil(self.max_model_len / self.block_size)

    def with_model_defaults(
        self, max_positions: int, source: str = "the checkpoint's max_position_embeddings"
    ) -> EngineConfig:
        """A new config with max_model_len filled in from the model and checked against it.

        `max_positions` is the model's longest sequence (`RopeSpec.max_positions`, the length of
        the ranks' cos/sin table: under YaRN, original_max_position_embeddings × factor unless
        max_position_embeddings says more); `source` says where it comes from, for the error.
        """
        if self.max_model_len is None:
            return dataclasses.replace(self, max_model_len=max_positions)
        _check(
            self.max_model_len <= max_positions,
            "max_model_len",
            f"({self.max_model_len}) exceeds the model's maximum length {max_positions} "
            f"({source}); positions past it have no rotary embedding",
        )
        return self


def parse_hf_overrides(value: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """`hf_overrides` as a dict: given as one, or as its JSON (the command line's form)."""
    if value is None or isinstance(value, dict):
        return value or None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"hf_overrides is not valid JSON: {e}") from e
    if not isinstance(parsed, dict):
        raise ValueError(f"hf_overrides must be a JSON object, got {value!r}")
    return parsed or None


def parse_partition(value: str | tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """Layers per pipeline stage, given as a tuple or list of ints or as "a,b" (the command
    line's and the environment's form)."""
    parts = value.split(",") if isinstance(value, str) else list(value)
    try:
        return tuple(int(part) for part in parts)
    except (TypeError, ValueError):
        raise ValueError(
            f"pp_layer_partition must list layer counts per stage, e.g. '3,1', got {value!r}"
        ) from None


# What pipeline parallelism refuses (at start-up, by name): (feature, field, whether it is on).
_PP_REFUSED: tuple[tuple[str, str, Any], ...] = (
    # n-gram drafts are rank 0's alone and verify rows are logits rows: that works as it is.
    (
        "speculative decoding with a draft model or an EAGLE-3 head",
        "speculative_config",
        lambda c: c.speculative_config is not None and c.speculative_config.method != "ngram",
    ),
    ("the host-memory KV tier", "kv_offloading_size", lambda c: c.kv_offloading_size is not None),
)


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")
