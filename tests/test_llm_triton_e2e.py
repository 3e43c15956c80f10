"""`LLM.generate` on the Triton path against Hugging Face transformers, at TP = 2 (gloo, CPU).

The Triton path is the project's paged-attention kernels and, following them, the fused layer
kernels (add+RMSNorm, q/k norm + rotary, SiLU·mul): interpreted on CPU, native on a GPU. The
engine runs the GPU's data paths here (`gpu_data_paths`): the kernels get the device-side
gather's strided block tables, and inputs are double-buffered as on a GPU. TP = 1
is covered by test_model_tp.py (every checkpoint, plan by plan) and test_attention_backends.py
(the engine, against the torch path). A module of its own: test_llm_e2e.py keeps a process
group open for the whole of its module, and a process can hold only one.
"""

from __future__ import annotations

import pytest

from tests.test_llm_e2e import MAX_TOKENS, check_matches_hf, make_prompts
from tests.tp_cases import CHECKPOINTS, MAX_MODEL_LEN, hf_greedy
from tp_engine import LLM

pytestmark = pytest.mark.slow

CKPT = "tied_kv2_oddvocab"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """That checkpoint alone, with one layer: every kernel still runs at every step, and under
    the interpreter a second layer nearly doubles the time."""
    from tp_engine.testing import build_random_qwen3

    shape = {**CHECKPOINTS[CKPT], "num_layers": 1}
    root = tmp_path_factory.mktemp("ckpt")
    return str(build_random_qwen3(root / CKPT, max_position_embeddings=MAX_MODEL_LEN, **shape))


@pytest.fixture(scope="module")
def references(checkpoint) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    from transformers import AutoConfig

    prompts = make_prompts(AutoConfig.from_pretrained(checkpoint).vocab_size)
    return {CKPT: (prompts, hf_greedy(checkpoint, prompts, MAX_TOKENS))}


def test_triton_kernels_match_hf_tp2(checkpoint, references):
    """Prefix caching, prompts chunked by the budget next to decodes, asynchronous scheduling."""
    with LLM(
        checkpoint, tensor_parallel_size=2, attention_backend="triton", block_size=4,
        num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=32, async_scheduling=True,
        gpu_data_paths=True,
    ) as llm:  # fmt: skip
        llm.ckpt_name = CKPT
        runner = llm.engine.runner
        assert runner.layer_kernels == "triton"
        # The K/V store runs inside the q/k norm + rotary kernel on this path.
        assert all(layer.self_attn.fused_kv_store for layer in runner.model.model.layers)
        assert runner.block_tables.has_device_copy and runner.input_buffers.double_buffered
        check_matches_hf(llm, references)
