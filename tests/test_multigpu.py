"""NCCL tensor parallelism on two or more GPUs (skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from tests.tp_cases import build_checkpoints
from tp_engine import LLM, SamplingParams

pytestmark = [pytest.mark.multigpu, pytest.mark.slow]


@pytest.mark.parametrize("tp", [2, 4])
def test_nccl_tensor_parallel_matches_one_gpu(tmp_path, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    model = str(build_checkpoints(tmp_path)["tied_kv2_oddvocab"])
    prompts = [[1, 2, 3, 4, 5], list(range(10, 40)), [7] * 17]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kwargs = dict(dtype="float32", block_size=16, num_kv_blocks=64, enforce_eager=True)

    with LLM(model, tensor_parallel_size=1, **kwargs) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    with LLM(model, tensor_parallel_size=tp, dist_backend="nccl", **kwargs) as many:
        got = [o.outputs[0].token_ids for o in many.generate(prompts, params, use_tqdm=False)]
    assert got == expected
