"""The engine's command-line flags: one table, read by every script that starts an engine.

Each `Flag` is an `EngineConfig` field: its name on the command line is the field's with dashes
(vLLM's spelling), its default is the field's own default (so `--help` and `EngineConfig()` can
never disagree), and `engine_kwargs(args)` hands the parsed values back to `EngineConfig` (or to
`LLM(...)`, which takes the same keywords) without a field-by-field copy. `launch/serve.py`
adds them all (`tp_engine.server.args`), `launch/generate.py` and `launch/bench.py` all but the
ones they spell otherwise. `FIELDS_WITHOUT_FLAGS` names the fields no flag sets, and why; a test
holds every field to one or the other.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tp_engine.config.engine import (
    ATTENTION_BACKENDS,
    CONVERTS,
    DTYPES,
    KV_CACHE_DTYPES,
    LORA_DTYPES,
    MAX_LORA_RANKS,
    RUNNERS,
    EngineConfig,
)


@dataclass(frozen=True)
class Flag:
    """One engine flag: `--{field with dashes}` (or `name`), setting `EngineConfig.{field}`."""

    field: str
    help: str
    type: Callable[[str], Any] | None = None
    # The allowed values.
    choices: tuple[Any, ...] | None = None
    # "value" (takes an argument), "switch" (store_true) or "toggle" (--x / --no-x).
    kind: str = "value"
    name: str | None = None  # when the flag is not the field's name with dashes
    metavar: str | None = None
    group: str | None = None  # a heading in --help (`GROUPS`)

    @property
    def option(self) -> str:
        return self.name or "--" + self.field.replace("_", "-")


# --help headings, with a line under each.
GROUPS = {
    "lora": ("LoRA adapters", "serve PEFT adapters on the base model, mixed in one batch"),
}


def tokenizer_dir(value: str) -> str:
    """vLLM's --tokenizer, as a local directory (nothing is downloaded)."""
    if not (Path(value) / "tokenizer_config.json").is_file():
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a tokenizer directory (no tokenizer_config.json; "
            "save one with tokenizer.save_pretrained(DIR))"
        )
    return value


ENGINE_FLAGS: tuple[Flag, ...] = (
    Flag("tokenizer", "directory of the tokenizer files (default: the checkpoint's own)",
         type=tokenizer_dir, metavar="DIR"),
    Flag("max_model_len", "longest prompt + output in tokens (default: the checkpoint's "
         "max_position_embeddings, or its YaRN length)", type=int),
    Flag("max_num_seqs", "most sequences in one step", type=int),
    Flag("max_num_batched_tokens", "most new tokens in one step (default: 8192 with chunked "
         "prefill, else max(max_model_len, 8192))", type=int),
    Flag("block_size", "tokens per KV-cache block", type=int),
    Flag("enable_prefix_caching", "reuse full KV blocks across requests that share a prefix",
         kind="toggle"),
    Flag("enable_chunked_prefill", "split long prompts into chunks that fit the token budget, "
         "batched with decodes", kind="toggle"),
    Flag("enforce_eager", "never capture CUDA graphs", kind="switch"),
    Flag("cuda_graph_max_tokens", "largest step with prompt tokens captured in a CUDA graph, "
         "in tokens; larger ones run eagerly (default: 512, at most --max-num-batched-tokens; "
         "0: decode graphs only)", type=int),
    Flag("async_scheduling", "schedule step t+1 while step t runs (default: on with a GPU, off "
         "on CPU; off with speculative decoding)", kind="toggle"),
    Flag("speculative_config", "speculative decoding, vLLM's shape: '{\"method\": \"ngram\", "
         "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}', a draft model's "
         "'{\"method\": \"draft_model\", \"model\": DIR, \"num_speculative_tokens\": 4}' "
         "or an EAGLE-3 head's '{\"method\": \"eagle3\", \"model\": DIR, "
         "\"num_speculative_tokens\": 3}'", metavar="JSON"),
    Flag("gpu_memory_utilization", "fraction of each GPU's memory the engine may use (weights, "
         "activations, KV cache)", type=float),
    Flag("dtype", "parameter dtype (auto: the checkpoint's torch_dtype on a GPU, float32 on CPU)",
         choices=DTYPES),
    Flag("seed", "seed of the random generators on every rank", type=int),
    Flag("attention_backend", "attention kernels (auto: flash_attn when installed and "
         "--block-size is a multiple of 256, else triton on a GPU, torch on CPU)",
         choices=ATTENTION_BACKENDS),
    Flag("enable_expert_parallel", "MoE models: whole experts per rank instead of a slice of "
         "every expert", kind="switch"),
    Flag("kv_cache_dtype", "KV-cache storage (auto: the model's dtype; fp8: e4m3 with "
         "per-layer scales, half the bytes of bf16)", choices=KV_CACHE_DTYPES),
    Flag("num_kv_blocks", "fix the KV pool size (blocks per rank) instead of measuring memory",
         type=int),
    Flag("kv_cache_memory_bytes", "KV-cache bytes per rank when memory is not measured (the "
         "CPU path; default: 1 GiB on CPU)", type=int),
    Flag("kv_offloading_size", "GiB of host memory per rank for a KV tier below the GPU's: "
         "full blocks the GPU pool evicts are copied there and found again by the prefix "
         "cache (default: none)", type=float, metavar="GIB"),
    Flag("kv_offloading_dir", "a directory for a KV tier of block files below host memory "
         "(needs --kv-offloading-size): written through from it, read again by a restarted "
         "server on the same checkpoint (default: none)", metavar="PATH"),
    Flag("kv_offloading_dir_size", "GiB of block files (every rank's) kept in "
         "--kv-offloading-dir, least recently used evicted", type=float, metavar="GIB"),
    Flag("runner", "generate (completions, chat) or pooling (embeddings, scores); auto: "
         "pooling for a sentence-transformers checkpoint (modules.json) or a "
         "*ForSequenceClassification one", choices=RUNNERS),
    Flag("convert", "what a pooling runner makes of the model: embed (last-token embedding) or "
         "classify (scores); auto: classify for *ForSequenceClassification, else embed",
         choices=CONVERTS),
    Flag("hf_overrides", "config.json fields to override, one JSON object, e.g. "
         "'{\"is_matryoshka\": true}' or a Qwen3-Reranker's '{\"architectures\": "
         "[\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": [\"no\", \"yes\"], "
         "\"is_original_qwen3_reranker\": true}'", metavar="JSON"),
    Flag("structured_outputs_timeout_s", "seconds a request's output constraint may take to "
         "check (API process) and to compile (rank 0); slower ones are answered 400, the other "
         "requests are unaffected", type=float, name="--structured-outputs-timeout"),
    Flag("enable_lora", "serve LoRA adapters", kind="switch", group="lora"),
    Flag("max_loras", "most distinct adapters in one batch (slots)", type=int, group="lora"),
    Flag("max_lora_rank", "largest adapter rank served", type=int, choices=MAX_LORA_RANKS,
         group="lora"),
    Flag("max_cpu_loras", "adapters kept in host memory (default: --max-loras)", type=int,
         group="lora"),
    Flag("lora_dtype", "adapter weights' dtype (auto: the model's)", choices=LORA_DTYPES,
         group="lora"),
)  # fmt: skip

# Fields no flag of the table sets, and why.
FIELDS_WITHOUT_FLAGS = {
    "model": "each script spells it (bench.py also takes Qwen3 size presets)",
    "tensor_parallel_size": "from torchrun's WORLD_SIZE when not given: each script resolves it",
    "pipeline_parallel_size": "part of the world's size (TP x PP), spelt beside "
    "--tensor-parallel-size by the scripts that take it (serve.py: --pipeline-parallel-size/-pp)",
    "pp_layer_partition": "$TP_ENGINE_PP_LAYER_PARTITION (vLLM's VLLM_PP_LAYER_PARTITION), or "
    "LLM(pp_layer_partition=...)",
    "gpu_data_paths": "tests only: the GPU's data paths on CPU",
    "disaggregation": "set by serve.py's rank 0 from --disaggregation-mode (the server's flag: "
    "prefill/decode disaggregation is a server's role)",
}

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def add_engine_flags(parser: argparse.ArgumentParser, *, exclude: Iterable[str] = ()) -> list[Flag]:
    """Add every engine flag but the fields in `exclude` to `parser` (LoRA's under their own
    heading); returns the flags added, for `engine_kwargs`."""
    skip = set(exclude)
    groups: dict[str, Any] = {}
    for flag in ENGINE_FLAGS:
        if flag.field in skip:
            continue
        target: Any = parser
        if flag.group is not None:
            if flag.group not in groups:
                groups[flag.group] = parser.add_argument_group(*GROUPS[flag.group])
            target = groups[flag.group]
        kwargs: dict[str, Any] = {"dest": flag.field, "default": _DEFAULTS[flag.field],
                                  "help": flag.help}  # fmt: skip
        if flag.kind == "switch":
            kwargs["action"] = "store_true"
        elif flag.kind == "toggle":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.update(type=flag.type, choices=flag.choices, metavar=flag.metavar)
        target.add_argument(flag.option, **kwargs)
    return groups


def engine_kwargs(args: argparse.Namespace, *, exclude: Iterable[str] = ()) -> dict[str, Any]:
    """The `EngineConfig` (and `LLM(...)`) keywords of the engine flags parsed into `args`: the
    flags `add_engine_flags` added with the same `exclude`."""
    skip = set(exclude)
    return {f.field: getattr(args, f.field) for f in ENGINE_FLAGS if f.field not in skip}
