"""`LLM.generate` on a Qwen3-MoE checkpoint end to end against transformers (float32, CPU).

TP = 1, 2 and 4 (ranks 1..N-1 real processes over gloo), the experts tensor-parallel and, at
TP > 1, expert-parallel (6 experts: 3 + 3 at TP = 2, 2 + 2 + 1 + 1 at TP = 4): greedy token
ids must equal transformers' for every prompt, with prefix caching and chunked prefill, with a
token budget that chunks every prompt, with a KV pool small enough to force preemption, and
with asynchronous scheduling.
One process group per (TP, placement) serves every scenario (`LLMEngine.reconfigure` changes
rank 0's knobs only).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.moe_cases import (
    MIN_ROUTER_MARGIN,
    build_moe_checkpoints,
    hf_greedy,
    load_hf_moe,
    router_margins,
)
from tests.tp_cases import MAX_MODEL_LEN
from tp_engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
CKPT = "moe_e6k2"


def make_prompts(vocab_size: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(0, vocab_size, (n,), generator=g).tolist()  # noqa: E731
    shared = rand(12)
    # Prompts sharing a 12-token (3-block) prefix, one that is another's exact prefix.
    return [rand(n) for n in (1, 5, 9, 17, 30, 41)] + [shared + rand(6), shared]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """The checkpoint, the prompts and transformers' greedy continuations."""
    model_dir = build_moe_checkpoints(tmp_path_factory.mktemp("moe"))[CKPT]
    model = load_hf_moe(model_dir)
    prompts = make_prompts(model.config.vocab_size)
    expected = hf_greedy(model, prompts, MAX_TOKENS)
    # No token of these sequences sits on a routing near-tie (tests/moe_cases.py).
    margin = router_margins(model, [p + e for p, e in zip(prompts, expected, strict=True)])
    assert margin > MIN_ROUTER_MARGIN
    return model_dir, prompts, expected


@pytest.fixture(
    scope="module", params=[(1, False), (2, False), (2, True), (4, False), (4, True)],
    ids=lambda p: f"tp{p[0]}-{'ep' if p[1] else 'tp'}",
)  # fmt: skip
def llm(request, reference):
    tp, expert_parallel = request.param
    engine = LLM(
        str(reference[0]),
        tensor_parallel_size=tp,
        enable_expert_parallel=expert_parallel,
        block_size=4,
        num_kv_blocks=128,
        max_num_seqs=8,
        max_num_batched_tokens=MAX_MODEL_LEN,
    )
    # Rank 0's share of the 6 experts of 16 features: whole ones of its own, or a slice of all.
    w13 = engine.engine.runner.model.model.layers[0].mlp.experts.w13_weight
    local_experts = {2: 3, 4: 2}[tp] if expert_parallel else 6
    assert tuple(w13.shape[:2]) == (local_experts, 2 * 16 // (1 if expert_parallel else tp))
    yield engine
    engine.shutdown()


def check_matches_hf(llm, reference, **knobs) -> list:
    _, prompts, expected = reference
    llm.engine.reconfigure(**knobs)  # a fresh block manager: an empty prefix cache
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, (out, exp) in enumerate(zip(outputs, expected, strict=True)):
        got = out.outputs[0].token_ids
        assert got == exp, f"prompt {i} (len {len(prompts[i])}): engine {got} != transformers {exp}"
    bm = llm.engine.core.scheduler.block_manager
    assert bm.usage == 0.0
    bm.check_integrity()
    return outputs


def test_prefix_caching_and_chunked_prefill(llm, reference):
    check_matches_hf(llm, reference, enable_prefix_caching=True, enable_chunked_prefill=True)
    # The same prompts again, without reconfiguring: long prompts start from the prefix cache.
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    _, prompts, expected = reference
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert sum(o.num_cached_tokens for o in outputs) > 0


def test_small_token_budget_chunks_every_prompt(llm, reference):
    check_matches_hf(llm, reference, max_num_batched_tokens=8, max_num_seqs=4)


def test_small_kv_pool_forces_preemption(llm, reference):
    # 14 blocks of 4 = 56 slots for 8 prompts of up to 41 + 8 tokens.
    check_matches_hf(llm, reference, num_kv_blocks=14)
    assert llm.engine.core.scheduler.num_preemptions > 0


def test_async_scheduling(llm, reference):
    # Step t+1 scheduled before step t's tokens are applied; its decodes read them on the device.
    check_matches_hf(llm, reference, async_scheduling=True, max_num_batched_tokens=8)
    assert llm.engine.async_scheduling
