"""The engine's flags are one table (`tp_engine.config.flags`): every `EngineConfig` field has a
flag or a stated reason not to, every script that starts an engine offers the same flags with
the same defaults (`tests/test_serve_help.py` reads each script's `--help`), parsed values reach `EngineConfig` unchanged, and `RunnerConfig` is derived
from `EngineConfig` by one function that copies every shared field."""

from __future__ import annotations

import dataclasses

import pytest

from rank_worker.runner_config import RunnerConfig
from tp_engine.config import EngineConfig
from tp_engine.config.flags import ENGINE_FLAGS, FIELDS_WITHOUT_FLAGS
from tp_engine.executor.rank_config import runner_config_for
from tp_engine.server.args import build_parser, engine_config

FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}


def test_every_field_has_a_flag_or_a_reason() -> None:
    flagged = [flag.field for flag in ENGINE_FLAGS]
    assert len(flagged) == len(set(flagged)), "a field with two flags"
    assert set(flagged).isdisjoint(FIELDS_WITHOUT_FLAGS)
    assert set(flagged) | set(FIELDS_WITHOUT_FLAGS) == set(FIELDS)


# A value other than the default for each flag that takes one (choices: the last choice).
NON_DEFAULTS = {
    "max_model_len": "96",
    "max_num_seqs": "7",
    "max_num_batched_tokens": "640",
    "block_size": "32",
    "gpu_memory_utilization": "0.5",
    "dtype": "bfloat16",
    "seed": "11",
    "attention_backend": "triton",
    "kv_cache_dtype": "fp8",
    "num_kv_blocks": "33",
    "kv_cache_memory_bytes": "123456",
    "cuda_graph_max_tokens": "96",
    "kv_offloading_size": "0.25",
    "kv_offloading_dir": "/tmp/kv-files",
    "kv_offloading_dir_size": "2.5",
    "runner": "pooling",
    "convert": "embed",
    "hf_overrides": '{"is_matryoshka": true}',
    "speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}',
    "structured_outputs_timeout_s": "4.5",
    "max_loras": "3",
    "max_lora_rank": "32",
    "max_cpu_loras": "5",
    "lora_dtype": "float16",
}


def test_parsed_flags_reach_engine_config_unchanged(tmp_path) -> None:
    from tp_engine.testing import build_tokenizer

    build_tokenizer(tmp_path).save_pretrained(tmp_path)
    argv = ["--tokenizer", str(tmp_path)]
    for flag in ENGINE_FLAGS:
        if flag.field in NON_DEFAULTS:
            argv += [flag.option, NON_DEFAULTS[flag.field]]
        elif flag.kind == "switch":
            argv.append(flag.option)
        elif flag.kind == "toggle":  # False for a default of True or None (auto), else True
            on = FIELDS[flag.field].default is False
            argv.append(flag.option if on else "--no-" + flag.option[2:])
    config = engine_config(build_parser().parse_args(argv), 1)
    default = EngineConfig()
    for flag in ENGINE_FLAGS:
        assert getattr(config, flag.field) != getattr(default, flag.field), flag.option
    assert config.max_num_seqs == 7 and config.structured_outputs_timeout_s == 4.5
    assert config.speculative_config.num_speculative_tokens == 3
    assert config.hf_overrides == {"is_matryoshka": True}
    assert config.enable_prefix_caching is False and config.async_scheduling is False


def test_defaults_are_the_configs() -> None:
    args = build_parser().parse_args([])
    for flag in ENGINE_FLAGS:
        assert getattr(args, flag.field) == FIELDS[flag.field].default, flag.option


def test_runner_config_copies_every_shared_field() -> None:
    config = EngineConfig(
        max_model_len=96, max_num_seqs=7, block_size=32, dtype="bfloat16", seed=11,
        gpu_memory_utilization=0.5, num_kv_blocks=33, kv_cache_memory_bytes=123456,
        enforce_eager=True, attention_backend="triton", enable_expert_parallel=True,
        kv_cache_dtype="fp8", gpu_data_paths=True, hf_overrides={"is_matryoshka": True},
        enable_lora=True, max_loras=3, max_lora_rank=32, max_cpu_loras=5, lora_dtype="float16",
        kv_offloading_size=0.25,
    )  # fmt: skip
    runner = runner_config_for(config)
    runner_fields = {f.name for f in dataclasses.fields(RunnerConfig)}
    shared = runner_fields & set(FIELDS)
    assert len(shared) > 15
    for name in shared - {"max_num_batched_tokens"}:  # that one is resolved
        assert getattr(runner, name) == getattr(config, name), name
    assert runner.max_num_batched_tokens == config.resolved_max_num_batched_tokens
    # What the ranks hear of that is not an engine field: derived here, or the ranks' own.
    assert runner_fields - set(FIELDS) == {
        "max_num_logits_rows", "max_num_sampled_rows", "draft_model", "eagle3_head", "head",
        "layer_kernels", "num_speculative_tokens",
    }  # fmt: skip


def test_sglang_hierarchical_cache_flags_are_the_offloading_size() -> None:
    parse = build_parser().parse_args
    args = parse(["--enable-hierarchical-cache", "--hicache-size", "2.5"])
    assert engine_config(args, 1).kv_offloading_size == 2.5
    assert engine_config(parse(["--kv-offloading-size", "3"]), 1).kv_offloading_size == 3.0
    assert engine_config(parse([]), 1).kv_offloading_size is None
    for argv, message in (
        (["--enable-hierarchical-cache"], "needs --hicache-size"),
        (["--hicache-size", "1"], "needs --enable-hierarchical-cache"),
        (["--enable-hierarchical-cache", "--hicache-size", "1", "--kv-offloading-size", "2"],
         "not both"),
        (["--kv-offloading-size", "0"], "kv_offloading_size must be > 0"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            engine_config(parse(argv), 1)
