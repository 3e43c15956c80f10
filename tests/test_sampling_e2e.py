"""Sampling features through `LLM` end to end (TP = 1, CPU, float32).

Logprobs and prompt logprobs against Hugging Face's logits, greedy decoding with penalties
against a hand-applied reference on Hugging Face's logits, seeded requests that do not depend
on their batch, `n > 1` sharing the prompt's KV blocks, stop strings spanning tokens,
min_tokens, generation-config defaults and `LLM.chat`. One engine serves the whole module, once
with synchronous and once with asynchronous scheduling.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.tp_cases import CHECKPOINTS, MAX_MODEL_LEN
from tp_engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

CKPT = "tied_kv2_oddvocab"
# What the module's checkpoint's generation_config.json adds (see test_generation_config_*).
GEN_DEFAULTS = {"temperature": 0.8, "top_k": 1, "max_new_tokens": 5}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tp_engine.testing import build_random_qwen3

    out = build_random_qwen3(
        tmp_path_factory.mktemp("ckpt") / CKPT,
        max_position_embeddings=MAX_MODEL_LEN,
        **CHECKPOINTS[CKPT],
    )
    gen_path = out / "generation_config.json"
    gen_path.write_text(json.dumps({**json.loads(gen_path.read_text()), **GEN_DEFAULTS}))
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(model_dir, request):
    engine = LLM(
        str(model_dir),
        block_size=4,
        num_kv_blocks=128,
        max_num_seqs=8,
        max_num_batched_tokens=MAX_MODEL_LEN,
        async_scheduling=request.param,
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0]  # [len, vocab]


def prompt_of(n: int, seed: int, vocab: int = 600) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def check_integrity(llm) -> None:
    bm = llm.engine.core.scheduler.block_manager
    assert bm.usage == 0.0 and not llm.engine.has_unfinished()
    bm.check_integrity()


# -- logprobs ---------------------------------------------------------------------------------


def assert_logprob_dict(d, ref_row: torch.Tensor, chosen: int, k: int, tok) -> None:
    top = ref_row.topk(k)
    assert list(d)[:1] == [chosen]  # the chosen token first, as vLLM
    assert set(top.indices.tolist()) | {chosen} == set(d)
    assert abs(d[chosen].logprob - ref_row[chosen].item()) < 1e-4
    assert d[chosen].rank == 1 + int((ref_row > ref_row[chosen]).sum())
    for rank, (t, lp) in enumerate(
        zip(top.indices.tolist(), top.values.tolist(), strict=True), start=1
    ):
        assert d[t].rank == rank and abs(d[t].logprob - lp) < 1e-4
    for t, entry in d.items():
        assert entry.decoded_token == tok.decode([t])


@pytest.mark.parametrize("budget", [MAX_MODEL_LEN, 8], ids=["whole", "chunked"])
def test_logprobs_and_prompt_logprobs_match_hf(llm, hf_model, budget):
    llm.engine.reconfigure(max_num_batched_tokens=budget)
    tok = llm.get_tokenizer()
    prompts = [prompt_of(21, 1), prompt_of(5, 2), prompt_of(1, 3)]
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=6, ignore_eos=True,
                       logprobs=3, prompt_logprobs=2, repetition_penalty=1.3),
        greedy(4, logprobs=0, prompt_logprobs=0),
        greedy(3, logprobs=2, prompt_logprobs=4),
    ]  # fmt: skip
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, sp, out in zip(prompts, params, outs, strict=True):
        completion = out.outputs[0]
        ref = torch.log_softmax(hf_logits(hf_model, prompt + completion.token_ids), -1)
        assert len(completion.logprobs) == len(completion.token_ids)
        for j, (token, d) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
            assert_logprob_dict(d, ref[len(prompt) - 1 + j], token, sp.logprobs, tok)
        expected_sum = sum(
            ref[len(prompt) - 1 + j, t].item() for j, t in enumerate(completion.token_ids)
        )
        assert abs(completion.cumulative_logprob - expected_sum) < 1e-3
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for p in range(1, len(prompt)):
            assert_logprob_dict(
                out.prompt_logprobs[p], ref[p - 1], prompt[p], sp.prompt_logprobs, tok
            )
    check_integrity(llm)


def test_prompt_logprobs_skip_prefix_cache_reads(llm, hf_model):
    llm.engine.reconfigure()
    prompt = prompt_of(17, 4)
    first = llm.generate([prompt], greedy(2), use_tqdm=False)[0]
    again = llm.generate([prompt], greedy(2), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 16
    out = llm.generate([prompt], greedy(2, prompt_logprobs=1), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # every prompt position must be computed
    ref = torch.log_softmax(hf_logits(hf_model, prompt), -1)
    got = [out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))]
    expected = [ref[p - 1, prompt[p]].item() for p in range(1, len(prompt))]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-4, rtol=0)
    assert out.outputs[0].token_ids == first.outputs[0].token_ids
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
    check_integrity(llm)


def test_max_tokens_0_scores_the_prompt_and_generates_nothing(llm, hf_model):
    """A prompt-only request (what echo with max_tokens 0 becomes): its prompt logprobs, in
    chunks, next to a request that generates; it samples nothing and ends "length"."""
    llm.engine.reconfigure(max_num_batched_tokens=8)
    tok = llm.get_tokenizer()
    prompts = [prompt_of(21, 6), prompt_of(9, 7), prompt_of(1, 8)]
    params = [SamplingParams(max_tokens=0, prompt_logprobs=2), greedy(3),
              SamplingParams(max_tokens=0, prompt_logprobs=0, n=2)]  # fmt: skip
    scored, generated, single = llm.generate(prompts, params, use_tqdm=False)
    for out in (scored, single):
        for completion in out.outputs:
            assert completion.token_ids == [] and completion.text == ""
            assert completion.finish_reason == "length"
    ref = torch.log_softmax(hf_logits(hf_model, prompts[0]), -1)
    for p in range(1, len(prompts[0])):
        assert_logprob_dict(scored.prompt_logprobs[p], ref[p - 1], prompts[0][p], 2, tok)
    assert single.prompt_logprobs == [None] and len(single.outputs) == 2
    assert len(generated.outputs[0].token_ids) == 3
    llm.engine.reconfigure()
    check_integrity(llm)


# -- penalties and min_tokens -----------------------------------------------------------------


def test_greedy_with_penalties_matches_reference_on_hf_logits(llm, hf_model):
    llm.engine.reconfigure()
    params = greedy(8, repetition_penalty=1.8, frequency_penalty=0.7, presence_penalty=0.5)
    prompt = prompt_of(9, 5)
    prompt = prompt + prompt[:4]  # repeated prompt tokens
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    ids = list(prompt)
    for _ in range(8):
        x = hf_logits(hf_model, ids)[-1].clone()
        output = ids[len(prompt) :]
        for t in set(ids):
            x[t] = x[t] / 1.8 if x[t] > 0 else x[t] * 1.8
        for t, count in Counter(output).items():
            x[t] -= 0.7 * count + 0.5
        ids.append(int(x.argmax()))
    assert got == ids[len(prompt) :]
    plain = llm.generate([prompt], greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    assert plain != got  # the penalties did change something


def test_min_tokens_holds_back_stop_token_ids(llm):
    llm.engine.reconfigure()
    prompt = prompt_of(6, 6)
    plain = llm.generate([prompt], greedy(6), use_tqdm=False)[0].outputs[0].token_ids
    stop = plain[0]
    out = llm.generate([prompt], greedy(6, stop_token_ids=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [stop]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)
    params = greedy(6, stop_token_ids=[stop], min_tokens=3)
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert len(got.token_ids) >= 3 and stop not in got.token_ids[:3]
    if got.finish_reason == "stop":  # the stop id may come back once min_tokens is reached
        assert got.token_ids[-1] == stop and stop not in got.token_ids[:-1]
    else:
        assert stop not in got.token_ids and len(got.token_ids) == 6


# -- seeds --------------------------------------------------------------------------------------


SEEDED = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=1234, max_tokens=8,
                        ignore_eos=True, presence_penalty=0.2)  # fmt: skip


def test_seeded_request_is_independent_of_its_batch(llm):
    llm.engine.reconfigure()
    prompt = prompt_of(7, 7)
    alone = llm.generate([prompt], SEEDED, use_tqdm=False)[0].outputs[0].token_ids
    others = [prompt_of(n, 10 + n) for n in (3, 12, 25, 5)]
    other_params = [
        SamplingParams(temperature=1.0, max_tokens=8),
        SamplingParams(temperature=0.0, max_tokens=3),
        SamplingParams(temperature=0.7, top_k=3, seed=9, max_tokens=8),
        SamplingParams(temperature=1.5, min_p=0.1, max_tokens=5),
    ]
    for position in (0, 2, 4):
        batch = others[:position] + [prompt] + others[position:]
        params = other_params[:position] + [SEEDED] + other_params[position:]
        outs = llm.generate(batch, params, use_tqdm=False)
        assert outs[position].outputs[0].token_ids == alone
    other_seed = SamplingParams(**{**SEEDED.__dict__, "seed": 4321})
    assert llm.generate([prompt], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
    unseeded = SamplingParams(**{**SEEDED.__dict__, "seed": None})
    runs = {tuple(o.outputs[0].token_ids) for o in llm.generate([prompt] * 4, unseeded,
                                                                 use_tqdm=False)}  # fmt: skip
    assert len(runs) > 1  # unseeded sequences get seeds of their own
    check_integrity(llm)


def test_seeded_tokens_are_the_same_in_both_scheduling_modes(model_dir):
    prompts = [prompt_of(7, 7), prompt_of(12, 3), prompt_of(5, 4)]
    params = [
        SEEDED,
        SamplingParams(temperature=0.7, top_k=3, seed=9, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=1.5, min_p=0.1, seed=-5, max_tokens=8, ignore_eos=True),
    ]
    tokens = {}
    for async_scheduling in (False, True):
        engine = LLM(str(model_dir), block_size=4, num_kv_blocks=128, max_num_seqs=8,
                     max_num_batched_tokens=MAX_MODEL_LEN, async_scheduling=async_scheduling)  # fmt: skip
        try:
            outs = engine.generate(prompts, params, use_tqdm=False)
            alone = engine.generate(prompts[:1], params[:1], use_tqdm=False)
        finally:
            engine.shutdown()
        tokens[async_scheduling] = [o.outputs[0].token_ids for o in outs]
        assert alone[0].outputs[0].token_ids == tokens[async_scheduling][0]
    assert tokens[False] == tokens[True]
    assert all(len(set(t)) > 1 for t in tokens[False])  # really sampled


def test_seeded_requests_survive_preemption(llm):
    # A 12-block pool (48 slots) for 6 sequences of up to 12 + 16 tokens: they preempt each
    # other, with asynchronous scheduling also while their draw is in flight (that draw is
    # discarded; sampling the position again draws the same). A seeded request must not notice
    # either way.
    prompts = [prompt_of(12, 50 + i) for i in range(6)]
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=16, ignore_eos=True)
        for i in range(6)
    ]
    llm.engine.reconfigure()
    roomy = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.engine.reconfigure(num_kv_blocks=12)
    tight = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert tight == roomy
    check_integrity(llm)


def test_an_exception_mid_step_loses_nothing(llm, monkeypatch):
    # Ctrl-C inside a step (with asynchronous scheduling: while another step is in flight).
    # The steps whose tokens were never applied are undone, so a caller that keeps stepping
    # gets exactly the outputs of an undisturbed run.
    engine = llm.engine
    engine.reconfigure()
    prompts = [prompt_of(n, 60 + n) for n in (3, 9, 14)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(6), use_tqdm=False)]
    build = engine.core.sampling.build
    calls = 0

    def failing_build(*args):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return build(*args)

    monkeypatch.setattr(engine.core.sampling, "build", failing_build)
    ids = [engine.add_request(f"x{i}", p, greedy(6))[0] for i, p in enumerate(prompts)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    interrupted = False
    while engine.has_unfinished() or not interrupted:
        try:
            step = engine.step()
        except KeyboardInterrupt:
            interrupted = True
            continue
        for out in step.outputs:
            tokens[out.seq_id] += out.new_token_ids
    assert interrupted
    assert [tokens[i] for i in ids] == expected
    check_integrity(llm)


# -- n > 1 --------------------------------------------------------------------------------------


def test_n_samples_share_the_prompt_blocks(llm):
    llm.engine.reconfigure()  # a fresh block manager: empty prefix cache, zero counters
    bm = llm.engine.core.scheduler.block_manager
    prompt = prompt_of(13, 8)  # 3 full blocks of 4 + 1 token
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True,
                            logprobs=1, prompt_logprobs=1)  # fmt: skip
    out = llm.generate([prompt], params, use_tqdm=False)
    assert len(out) == 1 and [c.index for c in out[0].outputs] == [0, 1, 2]
    # Samples 1 and 2 start from sample 0's three full prompt blocks.
    assert bm.prefix_cache_hits == 2 * 12
    assert bm.prefix_cache_queries == 3 * 13
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1  # seeds 11, 12, 13
    assert len(out[0].prompt_logprobs) == 13
    assert all(len(c.logprobs) == 6 for c in out[0].outputs)
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out[0].outputs]
    check_integrity(llm)


def test_n_samples_can_be_aborted_while_held(llm):
    engine = llm.engine
    engine.reconfigure()
    params = SamplingParams(n=3, max_tokens=2, ignore_eos=True)  # "length" whatever is drawn
    ids = engine.add_request("held", prompt_of(9, 9), params)
    assert ids == ["0_held", "1_held", "2_held"]
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("held", [1, 2], SamplingParams(n=2))
    assert engine.abort_request("2_held") and not engine.abort_request("2_held")
    reasons = {}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            reasons[out.seq_id] = out.finish_reason
    assert reasons == {"0_held": "length", "1_held": "length"}  # the aborted one says nothing
    check_integrity(llm)


# -- stop strings -------------------------------------------------------------------------------


def test_stop_string_spanning_two_tokens(llm):
    llm.engine.reconfigure()
    tok = llm.get_tokenizer()
    cases = 0
    for seed in range(20, 40):
        prompt = prompt_of(4, seed)
        tokens = llm.generate([prompt], greedy(8), use_tqdm=False)[0].outputs[0].token_ids
        full = tok.decode(tokens, skip_special_tokens=True)
        for i in range(1, len(tokens) - 1):
            # The text up to token i ends at `cut`; the stop string straddles it.
            cut = len(tok.decode(tokens[:i], skip_special_tokens=True))
            if not 0 < cut < len(full) or full[:cut] != tok.decode(tokens[:i]):
                continue
            stop = full[cut - 1 : cut + 1]
            if full.find(stop) != cut - 1 or not tok.decode(tokens[i : i + 1]).startswith(
                full[cut]
            ):
                continue
            got = llm.generate([prompt], greedy(8, stop=[stop]), use_tqdm=False)[0].outputs[0]
            assert got.text == full[: cut - 1]
            assert (got.finish_reason, got.stop_reason) == ("stop", stop)
            assert got.token_ids == tokens[: i + 1]  # generation stopped at that token
            cases += 1
            break
        if cases >= 3:
            break
    assert cases >= 3, "no greedy output had a stop string to build across tokens"


def test_stop_strings_are_searched_incrementally(llm, monkeypatch):
    # Not one full decode of the output per step (quadratic in its length): the text grows
    # through the incremental detokenizer, with one full decode for the final text.
    llm.engine.reconfigure()
    tok = llm.get_tokenizer()
    decode = tok.decode
    calls = []
    monkeypatch.setattr(
        tok, "decode", lambda ids, **kw: calls.append(len(ids)) or decode(ids, **kw)
    )
    prompt = prompt_of(5, 70)
    out = llm.generate([prompt], greedy(24, stop=["\u2603never\u2603"]), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 24 and out.outputs[0].finish_reason == "length"
    assert len(calls) <= 2, calls
    monkeypatch.setattr(tok, "decode", decode)
    assert out.outputs[0].text == decode(out.outputs[0].token_ids, skip_special_tokens=True)


# -- defaults and chat --------------------------------------------------------------------------


def test_generation_config_defaults_fill_unset_fields_only(llm):
    llm.engine.reconfigure()
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.8, 1, 5)
    assert defaults.top_p == 1.0  # not in the file: vLLM's default
    prompts = [prompt_of(5, 30), prompt_of(9, 31)]
    outs = llm.generate(prompts, use_tqdm=False)  # top_k = 1: greedy in effect
    expected = llm.generate(prompts, greedy(5), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    # A request's own fields win; SamplingParams() built directly keeps vLLM's defaults.
    assert llm.engine.default_sampling_params(top_k=None, temperature=0.0).temperature == 0.0
    assert SamplingParams().top_k == 0 and SamplingParams().max_tokens == 16


def test_chat_uses_the_chat_template(llm):
    llm.engine.reconfigure()
    tok = llm.get_tokenizer()
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me a story about a small robot."},
    ]
    outs = llm.chat(conversation, greedy(6), use_tqdm=False)
    text = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nTell me a story about a "
        "small robot.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert outs[0].prompt == text
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert outs[0].prompt_token_ids == ids
    direct = llm.generate([ids], greedy(6), use_tqdm=False)[0].outputs[0]
    assert outs[0].outputs[0].token_ids == direct.token_ids
    two = llm.chat([conversation, conversation[1:]], greedy(2), use_tqdm=False)
    assert len(two) == 2 and two[1].prompt.startswith("<|im_start|>user\n")


def test_logprob_limit_is_refused(llm):
    with pytest.raises(ValueError, match=r"SamplingParams\.logprobs=21 exceeds"):
        llm.generate([[1, 2]], SamplingParams(logprobs=21), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_skip_special_tokens_in_text(llm):
    from tp_engine.frontend.request_run import Sample, final_text

    tok = llm.get_tokenizer()
    words = tok("Hello world")["input_ids"]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for skip, expected in ((True, "Hello world"), (False, "Hello world<|im_end|>")):
        sample = Sample(SamplingParams(skip_special_tokens=skip), None)
        sample.token_ids = [*words, end]
        sample.finish_reason = "length"
        assert final_text(sample, tok) == expected


# -- logit_bias, allowed_token_ids, bad_words ---------------------------------------------------


def test_logit_bias_plus_100_forces_and_minus_100_bans(llm):
    prompts = [prompt_of(7, 40), prompt_of(5, 41), prompt_of(9, 42)]
    free = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(6), use_tqdm=False)]
    favourite = 123  # not what the model picks anywhere (checked below)
    assert all(favourite not in ids for ids in free)
    first = free[1][0]
    params = [
        greedy(6, logit_bias={favourite: 100.0}),
        greedy(6, logit_bias={str(first): -100}),  # JSON's string keys work too
        greedy(6),  # a row that asks for nothing in the same batch
    ]
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert out[0] == [favourite] * 6
    assert first not in out[1] and out[1] != free[1]
    assert out[2] == free[2]
    check_integrity(llm)


def test_allowed_token_ids_confine_every_token(llm):
    allowed = [3, 50, 77, 400, 641]
    prompts = [prompt_of(6, 43), prompt_of(8, 44)]
    params = [
        greedy(8, allowed_token_ids=allowed),
        SamplingParams(
            temperature=1.5, seed=3, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed
        ),
    ]
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(len(ids) == n for ids, n in zip(out, (8, 24), strict=True))
    assert set(out[0]) <= set(allowed) and set(out[1]) <= set(allowed)
    assert len(set(out[1])) > 1  # sampled among them, not stuck on one
    check_integrity(llm)


def _first_completion(output: list[int], banned: list[list[int]]) -> int | None:
    """The output position where a banned sequence first completes, if any."""
    for end in range(len(output)):
        for ids in banned:
            start = end + 1 - len(ids)
            if start >= 0 and output[start : end + 1] == ids:
                return end
    return None


def test_bad_words_never_complete_while_their_prefix_appears(llm):
    from tp_engine.sampling_params import tokenize_bad_words

    tokenizer = llm.engine.tokenizer
    prompt = prompt_of(8, 45)
    free = llm.generate([prompt], greedy(16), use_tqdm=False)[0].outputs[0].token_ids
    # A phrase of two of the free output's tokens that tokenizes back to them.
    pairs = [free[i : i + 2] for i in range(1, len(free) - 1)]
    pair = next(
        p
        for p in pairs
        if tokenizer(tokenizer.decode(p), add_special_tokens=False)["input_ids"] == p
    )
    word = tokenizer.decode(pair)
    banned = tokenize_bad_words(SamplingParams(bad_words=[word]), tokenizer).bad_words_token_ids
    assert pair in banned
    end = _first_completion(free, banned)
    assert end is not None and end >= 1
    out = llm.generate([prompt], greedy(16, bad_words=[word]), use_tqdm=False)[0].outputs[0]
    ids = out.token_ids
    assert _first_completion(ids, banned) is None
    # Greedy: the same tokens up to the banned one, its prefix included, then another token.
    assert ids[:end] == free[:end] and ids[end] != free[end]
    check_integrity(llm)


def test_token_constraints_are_refused_with_the_field_named(llm):
    vocab = llm.engine.vocab_size
    cases = {
        "logit_bias": greedy(2, logit_bias={vocab: 1.0}),
        "allowed_token_ids": greedy(2, allowed_token_ids=[1, vocab + 3]),
    }
    for field, params in cases.items():
        with pytest.raises(ValueError, match=rf"SamplingParams\.{field} .*outside the vocabulary"):
            llm.generate([[1, 2]], params, use_tqdm=False)
    # Nothing left to sample at the first step: the only allowed token is EOS while
    # min_tokens holds EOS back.
    eos = sorted(llm.engine.eos_token_ids)[0]
    nothing = SamplingParams(max_tokens=3, min_tokens=2, allowed_token_ids=[eos])
    with pytest.raises(ValueError, match=r"SamplingParams\.allowed_token_ids leaves no token"):
        llm.generate([[1, 2]], nothing, use_tqdm=False)
    assert not llm.engine.has_unfinished()
