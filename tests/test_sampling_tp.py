"""Seeded sampling across tensor-parallel sizes: TP = 1 and TP = 2 (a spawned gloo worker) give
the same tokens and logprobs for seeded requests, in different batch compositions.

Its own module so that its one process group starts with no other engine alive.
"""

from __future__ import annotations

import pytest

from tests.tp_cases import CHECKPOINTS, MAX_MODEL_LEN
from tp_engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

CKPT = "untied_kv1_sharded"  # one KV head: replicated at TP = 2; a vocabulary TP splits


def seeded(seed: int, **kw) -> SamplingParams:
    return SamplingParams(seed=seed, max_tokens=8, ignore_eos=True, logprobs=2, **kw)


PROMPTS = [[5, 9, 200, 17, 3, 3, 41], [100, 2, 2, 300, 18], list(range(40, 61)), [7]]
PARAMS = [
    seeded(1, temperature=1.0),
    seeded(2, temperature=0.7, top_k=20, top_p=0.9),
    seeded(3, temperature=1.2, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.5),
    seeded(4, temperature=1.0, presence_penalty=1.0, n=2),
]


def run(llm: LLM, order: list[int], filler: bool) -> dict[int, list]:
    prompts = [PROMPTS[i] for i in order]
    params = [PARAMS[i] for i in order]
    if filler:  # unseeded neighbours that change the batch and the shared generator's draws
        prompts += [[11, 12, 13], list(range(300, 330))]
        params += [SamplingParams(temperature=1.0, max_tokens=8)] * 2
    outs = llm.generate(prompts, params, use_tqdm=False)
    return {
        i: [(c.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs])
            for c in out.outputs]
        for i, out in zip(order, outs, strict=False)
    }  # fmt: skip


def test_seeded_requests_match_across_tp_sizes(tmp_path):
    from tp_engine.testing import build_random_qwen3

    model = build_random_qwen3(
        tmp_path / CKPT, max_position_embeddings=MAX_MODEL_LEN, **CHECKPOINTS[CKPT]
    )
    kwargs = dict(block_size=4, num_kv_blocks=96, max_num_seqs=8, max_num_batched_tokens=32)
    results = []
    for tp, order, filler in ((1, [0, 1, 2, 3], False), (2, [3, 2, 1, 0], True)):
        with LLM(str(model), tensor_parallel_size=tp, **kwargs) as llm:
            results.append(run(llm, order, filler))
    one, two = results
    for i in range(len(PROMPTS)):
        assert len(one[i]) == len(two[i]) == PARAMS[i].n
        for (tokens1, lps1), (tokens2, lps2) in zip(one[i], two[i], strict=True):
            assert tokens1 == tokens2, f"request {i}: TP=1 {tokens1} != TP=2 {tokens2}"
            for d1, d2 in zip(lps1, lps2, strict=True):
                assert d1.keys() == d2.keys()
                assert all(abs(d1[t] - d2[t]) < 1e-4 for t in d1)
    assert one[3][0][0] != one[3][1][0]  # n = 2: seeds 4 and 5
