"""What every rank is told of the engine's config (`RunnerConfig`), derived from `EngineConfig` in
one function, and the per-step row budgets rank 0's scheduler and the ranks' warm-up share."""

from __future__ import annotations

import dataclasses

from rank_worker.models.model_spec import HeadSpec
from rank_worker.pp import partition_from_env
from rank_worker.runner_config import RunnerConfig
from tp_engine.config import EngineConfig


def max_logits_rows_per_step(config: EngineConfig) -> int:
    """The most logits rows the scheduler can put in one step (what the memory warm-up must
    budget). A sequence asking for prompt logprobs takes a row per token it computes (its
    prompt rows, then its sampled row), any other a row if it samples. With chunked prefill the
    scheduler gives prompt logprobs at most max_num_seqs tokens per step, and such a sequence
    is one of the max_num_seqs: at most max_num_seqs + (max_num_seqs - 1) rows. Without it, a
    whole prompt's rows: up to every token of the step. Speculative decoding adds a row per
    draft: up to k more per sequence."""
    budget = config.resolved_max_num_batched_tokens
    if not config.enable_chunked_prefill:
        return budget
    return min(budget, (2 + _num_drafts(config)) * config.max_num_seqs - 1)


def max_sampled_rows_per_step(config: EngineConfig) -> int:
    """The most rows one step samples: one per sequence, and one per draft it verifies."""
    rows = (1 + _num_drafts(config)) * config.max_num_seqs
    return min(rows, config.resolved_max_num_batched_tokens)


def _num_drafts(config: EngineConfig) -> int:
    spec = config.speculative_config
    return 0 if spec is None else spec.num_speculative_tokens


def runner_config_for(config: EngineConfig, head: HeadSpec | None = None) -> RunnerConfig:
    """What every rank is told of `config`; `head`: the model's output head (None: LM head).

    Every field the two configs share by name is copied as it is; the rest is derived here,
    in one place: the resolved token budget, the logits and sampled rows one step can need, the
    draft model's (or EAGLE-3 head's) directory, the drafts per step, the head and the layers
    per pipeline stage (`pp_layer_partition`: the config's, else $TP_ENGINE_PP_LAYER_PARTITION's,
    read here on rank 0 only so that every rank splits the model alike)."""
    if config.max_model_len is None:
        raise ValueError("max_model_len is not resolved yet; call with_model_defaults first")
    shared = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(RunnerConfig)
        if f.name in _ENGINE_FIELDS and f.name not in _DERIVED
    }
    return RunnerConfig(
        **shared,
        max_num_batched_tokens=config.resolved_max_num_batched_tokens,
        max_num_logits_rows=max_logits_rows_per_step(config),
        max_num_sampled_rows=max_sampled_rows_per_step(config),
        draft_model=draft_model_dir(config),
        eagle3_head=eagle3_head_dir(config),
        num_speculative_tokens=_num_drafts(config),
        head=None if head is None else head.to_dict(),
        pp_layer_partition=pp_layer_partition(config),
    )


def pp_layer_partition(config: EngineConfig) -> tuple[int, ...] | None:
    """Layers per pipeline stage as asked: the config's, else the environment's (None: vLLM's
    even split, `rank_worker.pp.layer_partition`)."""
    if config.pp_layer_partition is not None:
        return config.pp_layer_partition
    return partition_from_env()


_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))
# RunnerConfig fields that `runner_config_for` derives rather than copies.
_DERIVED = frozenset(
    {"max_num_batched_tokens", "max_num_logits_rows", "max_num_sampled_rows", "draft_model",
     "eagle3_head", "num_speculative_tokens", "head", "pp_layer_partition"}
)  # fmt: skip


def draft_model_dir(config: EngineConfig) -> str | None:
    """The draft model's checkpoint directory, for speculative decoding with one."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    return spec.model


def eagle3_head_dir(config: EngineConfig) -> str | None:
    """The EAGLE-3 head's directory, for speculative decoding with one."""
    spec = config.speculative_config
    if spec is None or spec.method != "eagle3":
        return None
    return spec.model
