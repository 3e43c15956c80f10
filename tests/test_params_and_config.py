"""SamplingParams and EngineConfig: vLLM's defaults, and clear errors for bad values."""

from __future__ import annotations

import math

import pytest

from tp_engine.config import EngineConfig
from tp_engine.sampling_params import SamplingParams


def test_sampling_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.ignore_eos, p.seed) == (16, 0, False, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None
    assert not p.is_greedy and SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**70}, "seed"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs"),
        ({"max_tokens": True}, "max_tokens"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**kwargs)


def test_engine_config_defaults_use_vllm_names():
    c = EngineConfig()
    assert (c.max_num_seqs, c.block_size, c.enable_prefix_caching, c.enable_chunked_prefill) == (
        256,
        16,
        True,
        True,
    )
    assert (c.gpu_memory_utilization, c.enforce_eager, c.dtype, c.tensor_parallel_size) == (
        0.9,
        False,
        "auto",
        1,
    )
    with pytest.raises(AttributeError):
        c.block_size = 32  # frozen


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"block_size": 12}, "block_size"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization"),
        ({"dtype": "int8"}, "dtype"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"num_kv_blocks": 0}, "num_kv_blocks"),
        ({"max_num_batched_tokens": 4, "max_num_seqs": 8}, "max_num_batched_tokens"),
        (
            {"max_num_batched_tokens": 512, "max_model_len": 1024, "enable_chunked_prefill": False},
            "max_num_batched_tokens",
        ),
    ],
)
def test_invalid_engine_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} "):
        EngineConfig(**kwargs)


def test_model_defaults_fill_max_model_len_in_a_new_object():
    c = EngineConfig(enable_chunked_prefill=False, max_num_seqs=4)
    resolved = c.with_model_defaults(max_positions=40960)
    assert c.max_model_len is None and resolved.max_model_len == 40960
    assert resolved.resolved_max_num_batched_tokens == 40960  # a whole prompt fits one step
    assert EngineConfig(max_model_len=1024).resolved_max_num_batched_tokens == 8192
    assert resolved.max_blocks_per_seq == 40960 // 16
    with pytest.raises(
        ValueError,
        match=r"\(50000\) exceeds the model's maximum length 40960 \(the checkpoint's max_pos",
    ):
        EngineConfig(max_model_len=50_000).with_model_defaults(40960)


def test_attention_backend_names_are_the_ones_the_ranks_know():
    # The config (torch-free, checked before any process starts) and the ranks' registry list
    # the backends separately; they must agree.
    from rank_worker.attention.selection import BACKEND_NAMES
    from tp_engine.config import ATTENTION_BACKENDS

    assert ATTENTION_BACKENDS == BACKEND_NAMES
