"""Speculative decoding end to end on one rank: seeded sampling, logprobs and stop conditions
are those without speculation, and the metrics carry vLLM's names. (The greedy comparison with
transformers at TP 1, 2 and 4 is in `test_speculative`.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.test_speculative import CKPT, MAX_TOKENS, NGRAM, _llm, make_prompts
from tests.tp_cases import build_checkpoints
from tp_engine import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_checkpoints(tmp_path_factory.mktemp("ckpt"))[CKPT]


def test_sampled_outputs_and_logprobs_are_those_without_speculation(checkpoint):
    """Seeded sampling (temperature, top-k, top-p, min-p, logit bias), logprobs of the emitted
    tokens, stop token ids, stop strings and max_tokens: identical with and without drafts."""
    prompts = make_prompts(643)
    params = [
        SamplingParams(
            temperature=0.8,
            top_k=20,
            top_p=0.9,
            seed=i,
            max_tokens=MAX_TOKENS,
            logprobs=2,
            ignore_eos=True,
        )
        for i in range(len(prompts))
    ]
    params[0] = SamplingParams(temperature=0.5, min_p=0.1, seed=1, max_tokens=MAX_TOKENS,
                               logit_bias={7: 2.0}, ignore_eos=True)  # fmt: skip
    params[1] = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    runs = {}
    for spec in (None, NGRAM):
        with _llm(checkpoint, 1, spec) as llm:
            runs[spec is not None] = llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
            )
            if spec is not None:
                stats = llm.engine.spec_stats
                assert stats.num_accepted_tokens > 0
                # Stop conditions inside an accepted run of drafts: the greedy outputs of the
                # repeated prompts with a stop token id and a stop string taken from them.
                greedy = runs[True][1].outputs[0].token_ids
                stop_id = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                         stop_token_ids=[greedy[3]], ignore_eos=True)  # fmt: skip
                got = llm.generate([{"prompt_token_ids": prompts[1]}], stop_id, use_tqdm=False)
                assert got[0].outputs[0].token_ids == greedy[: greedy.index(greedy[3]) + 1]
    base, spec_run = runs[False], runs[True]
    for i, (a, b) in enumerate(zip(base, spec_run, strict=True)):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, f"prompt {i}"
        if a.outputs[0].logprobs is not None:
            assert len(b.outputs[0].logprobs) == len(a.outputs[0].token_ids)
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
                assert x.keys() == y.keys()
                for t in x:
                    assert abs(x[t].logprob - y[t].logprob) < 1e-4


def test_metrics_have_vllms_names(checkpoint):
    with _llm(checkpoint, 1, NGRAM) as llm:
        prompts = make_prompts(643)[:4]
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        metrics = {m.name: m for m in llm.get_metrics()}
        stats = llm.engine.spec_stats
    drafts = metrics["vllm:spec_decode_num_drafts"].value
    assert drafts == stats.num_drafts > 0
    assert metrics["vllm:spec_decode_num_draft_tokens"].value == stats.num_draft_tokens
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    assert 0 < accepted == stats.num_accepted_tokens
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    assert len(per_pos) == 3 and sum(per_pos) == accepted
    assert per_pos == sorted(per_pos, reverse=True)  # a later position needs the earlier ones


def test_structured_outputs_are_those_without_speculation(tmp_path):
    """Every kind of constraint, greedy and seeded: the mask applies at every verified
    position (the matcher follows the drafts and is rolled back), so the tokens are those
    without speculation (whose validity `test_structured_outputs` checks), and drafts of
    constrained rows were verified."""
    from tests.test_structured_outputs import MAX_MODEL_LEN as LONG
    from tests.test_structured_outputs import prompts, requests
    from tests.tp_cases import CHECKPOINTS
    from tp_engine.testing import build_random_qwen3

    model = build_random_qwen3(tmp_path / CKPT, max_position_embeddings=LONG, **CHECKPOINTS[CKPT])
    reqs = [r for r in requests() if r[1].n == 1]
    # Prompts that repeat themselves, so that n-gram lookup drafts from the first step on.
    prompt_ids = [(p * 3)[:40] for p in prompts(len(reqs))]
    runs = {}
    for spec in (None, NGRAM):
        with LLM(str(model), block_size=4, num_kv_blocks=256, max_num_seqs=8,
                 max_num_batched_tokens=LONG, speculative_config=spec) as llm:  # fmt: skip
            runs[spec is not None] = llm.generate(
                [{"prompt_token_ids": p} for p in prompt_ids],
                [p for _, p in reqs],
                use_tqdm=False,
            )
            if spec is not None:
                stats = llm.engine.spec_stats
                assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    for (kind, _), a, b in zip(reqs, runs[False], runs[True], strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, kind


def test_min_tokens_and_thinking_budget_rows_draft_once_past_their_condition(checkpoint):
    """Rows with min_tokens, and rows whose thinking budget forces `</think>`, are not drafted
    while the condition holds (their logits edits would depend on the drafts) but are once it
    is past: drafts of theirs are accepted, and the tokens are those without speculation."""
    prompts = [{"prompt_token_ids": p} for p in make_prompts(643)[:5]]
    greedy = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    thinking = SamplingParams(**greedy, thinking_token_budget=3, think_start_token_id=641,
                              think_end_token_id=642, thinking_in_prompt=True)  # fmt: skip
    with _llm(checkpoint, 1, None) as llm:
        plain = llm.generate(prompts, SamplingParams(**greedy), use_tqdm=False)
        # A stop id no output reaches: min_tokens then bans it (and nothing else happens).
        used = {t for o in plain for t in o.outputs[0].token_ids}
        min_tokens = SamplingParams(**greedy, min_tokens=6,
                                    stop_token_ids=[min(set(range(643)) - used)])  # fmt: skip
        base = {
            "min_tokens": llm.generate(prompts, min_tokens, use_tqdm=False),
            "thinking": llm.generate(prompts, thinking, use_tqdm=False),
        }
    for o in base["thinking"]:  # the budget forced `</think>` after 3 tokens
        assert o.outputs[0].token_ids[3] == 642
    with _llm(checkpoint, 1, NGRAM) as llm:
        for kind, params in (("min_tokens", min_tokens), ("thinking", thinking)):
            before = llm.engine.spec_stats.num_accepted_tokens
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert llm.engine.spec_stats.num_accepted_tokens > before, kind
            for i, (a, b) in enumerate(zip(base[kind], outs, strict=True)):
                assert b.outputs[0].token_ids == a.outputs[0].token_ids, (kind, i)


def _run_engine(llm: LLM, prompt: list[int], params: SamplingParams) -> list[tuple[int, int]]:
    """Step one request to its end: (tokens output, decode tokens) of every step."""
    engine = llm.engine
    engine.add_request("r", prompt, params)
    steps = []
    while engine.has_unfinished():
        out = engine.step()
        steps.append((sum(len(o.new_token_ids) for o in out.outputs), out.num_decode_tokens))
    return steps


def test_counters_count_what_was_output(checkpoint):
    """Accepted drafts are those that became output tokens (a step's tokens beyond its first),
    also when a stop token cuts an accepted run, and decode tokens exclude drafts that were
    not output: each step's decode tokens are its output tokens but the prompt's first one."""
    prompt = make_prompts(643)[3]
    greedy = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with _llm(checkpoint, 1, NGRAM) as llm:
        stats = llm.engine.spec_stats
        steps = _run_engine(llm, prompt, SamplingParams(**greedy))
    output = [n for n, _ in steps]
    assert stats.num_accepted_tokens == sum(output) - len(output) > 0
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # some drafts were rejected
    assert [d for _, d in steps] == [0] + output[1:]
    # The target as its own draft: every draft is accepted, and a stop token on the second
    # token of a run (one not output before) leaves the drafts after it accepted but never
    # output. (An n-gram run only repeats tokens output before, which would have stopped it.)
    own = {"method": "draft_model", "model": str(checkpoint), "num_speculative_tokens": 3}
    with _llm(checkpoint, 1, own) as llm:
        stats = llm.engine.spec_stats
        steps = _run_engine(llm, prompt, SamplingParams(**greedy))
        output = [n for n, _ in steps]
        assert stats.num_accepted_tokens == stats.num_draft_tokens == sum(output) - len(output)
        tokens = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**greedy),
                              use_tqdm=False)[0].outputs[0].token_ids  # fmt: skip
        ends = np.cumsum(output)
        stop_at = next(
            end - n + 1
            for end, n in zip(ends.tolist(), output, strict=True)
            if n == 4 and tokens[end - n + 1] not in tokens[: end - n + 1]
        )
        accepted, drafts = stats.num_accepted_tokens, stats.num_draft_tokens
        steps = _run_engine(llm, prompt, SamplingParams(**greedy, stop_token_ids=[tokens[stop_at]]))
    output = [n for n, _ in steps]
    assert output[-1] == 2 and sum(output) == stop_at + 1  # the run's last 2 drafts dropped
    assert stats.num_accepted_tokens - accepted == sum(output) - len(output)
    assert stats.num_draft_tokens - drafts == 3 * (len(output) - 1)
    assert [d for _, d in steps] == [0] + output[1:]
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
