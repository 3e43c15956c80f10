"""`LLM.generate` end to end against Hugging Face transformers (float32, CPU).

For TP = 1, 2 and 4 (ranks 1..N-1 are real processes over gloo) and two checkpoints (tied
embeddings with a vocabulary TP does not divide; untied, sharded, one KV head so every rank
replicates it), greedy token ids must equal transformers' for every prompt: with prefix caching
on and off, chunked prefill on and off, a KV pool small enough to force preemption, and
asynchronous scheduling. The
process group of each (checkpoint, TP) pair is started once and serves every scenario; the
scenarios change rank-0-only knobs with `LLMEngine.reconfigure`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tp_cases import MAX_MODEL_LEN, build_checkpoints, hf_greedy
from tp_engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
CKPTS = ("tied_kv2_oddvocab", "untied_kv1_sharded")


def make_prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(0, vocab_size, (n,), generator=g).tolist()  # noqa: E731
    shared = rand(12)
    lens = [1, 3, 4, 9, 16, 17, 30, 45]
    # Prompts that share a 12-token (3-block) prefix, and one that is another's exact prefix.
    return [rand(n) for n in lens] + [shared + rand(5), shared + rand(9), shared]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return build_checkpoints(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def references(checkpoints) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """prompts and transformers' greedy continuations, by checkpoint (full recompute each step)."""
    from transformers import AutoConfig

    refs = {}
    for name in CKPTS:
        prompts = make_prompts(AutoConfig.from_pretrained(checkpoints[name]).vocab_size)
        refs[name] = (prompts, hf_greedy(checkpoints[name], prompts, MAX_TOKENS))
    return refs


@pytest.fixture(scope="module", params=[(c, tp) for tp in (1, 2, 4) for c in CKPTS], ids=str)
def llm(request, checkpoints):
    name, tp = request.param
    engine = LLM(
        str(checkpoints[name]),
        tensor_parallel_size=tp,
        block_size=4,
        num_kv_blocks=128,
        max_num_seqs=8,
        max_num_batched_tokens=MAX_MODEL_LEN,
    )
    engine.ckpt_name = name
    yield engine
    engine.shutdown()


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def check_matches_hf(llm, references, **knobs) -> list:
    prompts, expected = references[llm.ckpt_name]
    if knobs:
        llm.engine.reconfigure(**knobs)  # a fresh block manager: an empty prefix cache
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs]
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"prompt {i} (len {len(prompts[i])}): engine {g} != transformers {e}"
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    bm = llm.engine.core.scheduler.block_manager
    assert bm.usage == 0.0
    bm.check_integrity()
    return outputs


def test_prefix_caching_and_chunked_prefill(llm, references):
    check_matches_hf(llm, references, enable_prefix_caching=True, enable_chunked_prefill=True)
    # The same prompts again: long prompts now start from the prefix cache.
    outputs = check_matches_hf(llm, references)
    assert sum(o.num_cached_tokens for o in outputs) > 0


def test_no_prefix_caching_no_chunked_prefill(llm, references):
    outputs = check_matches_hf(
        llm, references, enable_prefix_caching=False, enable_chunked_prefill=False
    )
    assert all(o.num_cached_tokens == 0 for o in outputs)


def test_small_token_budget_chunks_every_prompt(llm, references):
    check_matches_hf(llm, references, max_num_batched_tokens=8, max_num_seqs=4)


def test_small_kv_pool_forces_preemption(llm, references):
    # 16 blocks of 4 = 64 slots for 11 prompts of up to 45 + 10 tokens.
    check_matches_hf(llm, references, num_kv_blocks=16)
    assert llm.engine.core.scheduler.num_preemptions > 0


@pytest.mark.parametrize(
    "knobs",
    [{}, {"max_num_batched_tokens": 8, "max_num_seqs": 4}, {"num_kv_blocks": 16}],
    ids=["default", "small_budget", "small_pool"],
)
def test_async_scheduling(llm, references, knobs):
    # Step t+1 scheduled before step t is applied; decodes read step t's tokens on the device
    # (broadcast from rank 0 to the other ranks).
    check_matches_hf(llm, references, async_scheduling=True, **knobs)
    assert llm.engine.async_scheduling
    if "num_kv_blocks" in knobs:
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_prompt_forms_and_text(llm):
    tok = llm.get_tokenizer()
    text = "Hello, world!"
    ids = tok(text)["input_ids"]
    llm.engine.reconfigure()
    outs = llm.generate([text, ids, {"prompt_token_ids": ids}], greedy(4), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [ids, ids, ids]
    assert outs[0].prompt == text and outs[1].prompt is None
    first = outs[0].outputs[0]
    assert all(o.outputs[0].token_ids == first.token_ids for o in outs)
    assert first.text == tok.decode(first.token_ids, skip_special_tokens=True)


def test_stop_string_completed_by_the_last_token(llm):
    # The stop string ends exactly at the last allowed token: max_tokens and the stop string
    # fire in the same step, and the stop string must still win (text cut, reason "stop").
    llm.engine.reconfigure()
    prompts = [[i, i + 1, i + 2] for i in range(1, 200, 7)]
    outs = llm.generate(prompts, greedy(6), use_tqdm=False)
    cases = [(p, o.outputs[0].text) for p, o in zip(prompts, outs, strict=True)]
    cases = [(p, text) for p, text in cases if len(text) >= 2][:3]
    assert cases, "no prompt produced text to build a stop string from"
    for prompt, text in cases:
        stop = text[-2:]
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=[stop])
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert got.text == text[: text.find(stop)]
        assert (got.finish_reason, got.stop_reason) == ("stop", stop)


def test_bad_requests_are_refused_and_nothing_is_lost(llm):
    vocab = llm.engine.vocab_size
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 3], [vocab + 5]], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="integer token ids"):
        llm.generate([[1, 2, 3], {"prompt_token_ids": ["x"]}], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="integer token ids"):
        llm.generate([{"prompt_token_ids": [5.9, 6.2]}], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match=r"logprobs=50 exceeds the maximum"):
        llm.generate([[1, 2, 3], [4, 5]], SamplingParams(logprobs=50), use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([[1] * (MAX_MODEL_LEN - 2)], greedy(5), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    out = llm.generate([[1, 2, 3]], greedy(3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
