"""Structured outputs through `LLM` (TP = 1, CPU, float32) and their parts.

The constraint's parameters and their errors, the bitmask against a plain-torch reference, a
matcher's phases around Qwen3's thinking, and end to end on a random-weight model: every
constrained output validates (jsonschema, re.fullmatch, the choices), free rows of a mixed batch
get the tokens they get alone, and a constrained request's tokens do not change under chunked
prefill, preemption or asynchronous scheduling. One engine serves the end-to-end tests, once
with synchronous and once with asynchronous scheduling.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import jsonschema
import pytest
import torch

from tests.scripted_model import END_THINK, IM_END, THINK, Script, build_scripted_checkpoint
from tests.tp_cases import CHECKPOINTS
from tp_engine import LLM, SamplingParams
from tp_engine.common.thinking import ThinkingState
from tp_engine.core.sampling import GrammarMask
from tp_engine.core.sampling.grammar_mask import apply_token_bitmask, apply_token_bitmask_reference
from tp_engine.features.structured.grammar import (
    GrammarCompiler,
    GrammarState,
    StructuredOutputsParams,
    fill_bitmasks,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "ok", "count", "color"],
}
REGEX = r"[a-z]{2,6}@(foo|bar)\.(com|org)"
CHOICES = ["yes", "no", "not sure"]
# xgrammar's EBNF: sums of up to two terms, a term a digit or a parenthesised sum of two.
GRAMMAR = 'root ::= term | term "+" term\nterm ::= [1-9] | "(" [1-9] "+" [1-9] ")"'
GRAMMAR_RE = r"(\d|\(\d\+\d\))(\+(\d|\(\d\+\d\)))?"
MAX_MODEL_LEN = 256


def constraint(**kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 60)
    return SamplingParams(**kw)


def check_output(kind: str, text: str) -> None:
    """`text` satisfies the constraint of `kind` (as `requests()` below asks for it)."""
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    elif kind == "grammar":
        assert re.fullmatch(GRAMMAR_RE, text) and "0" not in text, text
    else:
        raise AssertionError(kind)


SPECS = {
    "json": {"json": SCHEMA},
    "json_object": {"json_object": True},
    "regex": {"regex": REGEX},
    "choice": {"choice": CHOICES},
    "grammar": {"grammar": GRAMMAR},
}


# -- the parameters ------------------------------------------------------------------------------


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match=r"got \['json', 'regex'\]"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match=r"structured_outputs\.choice must be a list"):
        StructuredOutputsParams(choice=["a", ""])
    with pytest.raises(ValueError, match="has no field 'jsn'"):
        SamplingParams(structured_outputs={"jsn": SCHEMA})


@pytest.mark.parametrize(
    ("spec", "field", "why"),
    [
        ({"json": {"type": "objekt"}}, "json", "objekt"),
        ({"json": "{not json"}, "json", "Expecting property name"),
        ({"json": "[1, 2]"}, "json", "must be an object"),
        ({"regex": "[a-"}, "regex", "Unclosed"),
        ({"grammar": "root ::= missing"}, "grammar", "missing"),
    ],
)
def test_check_names_the_field_and_the_reason(spec, field, why):
    params = StructuredOutputsParams(**spec)
    with pytest.raises(ValueError, match=rf"structured_outputs\.{field} is not valid: .*{why}"):
        params.check()


def test_params_survive_the_trip_to_rank_0():
    """The server sends SamplingParams as `asdict` over msgpack; rank 0 rebuilds them."""
    from dataclasses import asdict

    params = SamplingParams(structured_outputs={"json": SCHEMA})
    again = SamplingParams(**asdict(params))
    assert again.structured_outputs == params.structured_outputs
    # The schema's key order is the order the output must follow: the cache key keeps it.
    assert again.structured_outputs.key == ("json", json.dumps(SCHEMA))


# -- the mask --------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [(0, 1, 2, 3, 4, 5), (0, 2, 5), (4,)])
def test_bitmask_matches_the_reference(rows):
    gen = torch.Generator().manual_seed(0)
    vocab = 1000  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(6, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31, (6, (vocab + 31) // 32), generator=gen)
    mask = GrammarMask(bitmask.to(torch.int32), rows)
    ours, reference = logits.clone(), logits.clone()
    apply_token_bitmask(ours, mask)
    apply_token_bitmask_reference(reference, mask)
    assert torch.equal(ours, reference)
    for row in range(6):
        assert bool((ours[row] != logits[row]).any()) == (row in rows)


@pytest.mark.gpu
def test_bitmask_on_the_gpu_matches_the_reference():
    """xgrammar's Triton kernel on the GPU (what the engine runs there) against plain torch."""
    gen = torch.Generator().manual_seed(1)
    vocab = 151_936
    logits = torch.randn(8, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31, (8, vocab // 32), generator=gen).to(torch.int32)
    mask = GrammarMask(bitmask, (1, 4, 7))
    reference = logits.clone()
    apply_token_bitmask_reference(reference, mask)
    on_gpu = logits.cuda()
    apply_token_bitmask(on_gpu, GrammarMask(bitmask.cuda(), mask.rows))
    assert torch.equal(on_gpu.cpu(), reference)


def test_batched_fill_matches_one_by_one(think_tokenizer):
    tok = think_tokenizer
    eos = tok.convert_tokens_to_ids(IM_END)
    compiler = GrammarCompiler(tok, len(tok), [eos])
    compiled = compiler.submit(StructuredOutputsParams(json=SCHEMA)).result()
    think, end_think = tok.convert_tokens_to_ids([THINK, END_THINK])
    states = [GrammarState(compiled, think, end_think, ThinkingState.NOT_STARTED)]
    for text in ('{"name": "ab', '{"name": "a", "ok": tr', "{"):
        state = GrammarState(compiled)
        ids = tok.encode(text, add_special_tokens=False)
        assert state.advance(ids, 0)
        states.append(state)
    words = (len(tok) + 31) // 32
    one_by_one = torch.zeros(6, words, dtype=torch.int32)
    batched = torch.zeros(6, words, dtype=torch.int32)
    rows = [5, 0, 3, 1]
    for state, row in zip(states, rows, strict=True):
        state.fill(one_by_one, row)
    fill_bitmasks(states, batched, rows)
    assert torch.equal(one_by_one, batched)
    assert len({tuple(one_by_one[r].tolist()) for r in rows}) == 4  # four different states
    compiler.shutdown()


# -- a matcher around the thinking ---------------------------------------------------------------


@pytest.fixture(scope="module")
def think_tokenizer(tmp_path_factory):
    from tests.scripted_model import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"), [])


def allowed(state: GrammarState, vocab: int) -> set[int]:
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    state.fill(bitmask, 0)
    words = bitmask[0].tolist()
    return {t for t in range(vocab) if (words[t // 32] >> (t % 32)) & 1}


def test_matcher_phases_around_thinking(think_tokenizer):
    tok = think_tokenizer
    vocab = len(tok)
    think, end_think, eos = (tok.convert_tokens_to_ids(t) for t in (THINK, END_THINK, IM_END))
    compiler = GrammarCompiler(tok, vocab, [eos])
    compiled = compiler.submit(StructuredOutputsParams(choice=["yes", "no"])).result()
    first = {tok.convert_tokens_to_ids(tok.tokenize(c)[0]) for c in ("yes", "no")}
    prompt = [1, 2]

    # Thinking closed in the prompt: constrained from the first token.
    closed = GrammarState(compiled, think, end_think, ThinkingState.CLOSED)
    assert allowed(closed, vocab) == first
    # Not started: the grammar's tokens, or <think>.
    undecided = GrammarState(compiled, think, end_think, ThinkingState.NOT_STARTED)
    assert allowed(undecided, vocab) == first | {think}
    free = tok.encode("<b>", add_special_tokens=False)  # not allowed by the grammar
    tokens = [*prompt, think, *free]
    assert undecided.advance(tokens, len(prompt))
    assert not undecided.masks_next  # thinking: no mask
    tokens += [end_think]
    assert undecided.advance(tokens, len(prompt)) and undecided.masks_next
    assert allowed(undecided, vocab) == first
    tokens += tok.encode("no", add_special_tokens=False)
    assert undecided.advance(tokens, len(prompt))
    assert allowed(undecided, vocab) == {eos}  # complete: only the stop token
    # A sequence that ignores EOS goes on past the end: it may only stop again.
    assert undecided.advance([*tokens, eos, eos], len(prompt))
    assert allowed(undecided, vocab) == {eos}
    assert not undecided.advance([*tokens, eos, eos, think], len(prompt))
    # The sequence's output gets shorter: the matcher follows it back.
    assert undecided.advance(tokens[:-1], len(prompt))
    assert eos not in allowed(undecided, vocab)
    # Open in the prompt: unconstrained until </think>; a token the grammar forbids after it
    # breaks the constraint.
    open_ = GrammarState(compiled, think, end_think, ThinkingState.OPEN)
    assert not open_.masks_next
    assert open_.advance([*prompt, *free, end_think], len(prompt))
    assert not open_.advance([*prompt, *free, end_think, *free], len(prompt))
    compiler.shutdown()


# -- end to end ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tp_engine.testing import build_random_qwen3

    name = "tied_kv2_oddvocab"
    return build_random_qwen3(
        tmp_path_factory.mktemp("ckpt") / name,
        max_position_embeddings=MAX_MODEL_LEN,
        **CHECKPOINTS[name],
    )


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(model_dir, request):
    engine = LLM(
        str(model_dir),
        block_size=4,
        num_kv_blocks=256,
        max_num_seqs=8,
        max_num_batched_tokens=MAX_MODEL_LEN,
        async_scheduling=request.param,
    )
    yield engine
    engine.shutdown()


def prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 600, (5 + 3 * i,), generator=gen).tolist() for i in range(n)]


def requests() -> list[tuple[str, SamplingParams]]:
    """One request per kind, greedy and seeded, one with n = 2. (Any JSON object is not
    bounded, and a random model sampling may never close it: that kind is greedy only.)"""
    out = []
    for kind, spec in SPECS.items():
        out.append((kind, constraint(structured_outputs=spec)))
        if kind != "json_object":
            out.append((kind, constraint(structured_outputs=spec, temperature=1.0, seed=11)))
    out.append(("json", constraint(structured_outputs=SPECS["json"], temperature=0.8, n=2)))
    return out


def run(llm, reqs, prompt_ids=None):
    prompt_ids = prompt_ids or prompts(len(reqs))
    return llm.generate(
        [{"prompt_token_ids": p} for p in prompt_ids], [p for _, p in reqs], use_tqdm=False
    )


def follows_grammar(llm, kind: str, token_ids: list[int]) -> bool:
    """Whether a fresh matcher of the constraint accepts every one of `token_ids`."""
    import xgrammar as xgr

    compiled = llm.engine.core.grammars.submit(StructuredOutputsParams(**SPECS[kind])).result()
    matcher = xgr.GrammarMatcher(compiled)
    return all(matcher.accept_token(t) for t in token_ids)


def test_every_constrained_output_validates(llm):
    reqs = requests()
    outputs = run(llm, reqs)
    for (kind, _), out in zip(reqs, outputs, strict=True):
        for sample in out.outputs:
            assert follows_grammar(llm, kind, sample.token_ids)
            if kind == "json_object" and sample.finish_reason == "length":
                continue  # a random model may never close an object's key: a prefix then
            assert sample.finish_reason == "stop", (kind, sample.text)
            check_output(kind, sample.text)
    assert not llm.engine.has_unfinished()


def test_free_rows_of_a_mixed_batch_are_unaffected(llm):
    free = [
        ("free", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)),
        ("free", SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)),
        ("free", SamplingParams(temperature=0.7, top_p=0.9, seed=6, max_tokens=24, logprobs=2)),
    ]
    alone = run(llm, free, prompts(3))
    constrained = requests()[:6]
    mixed = run(llm, free + constrained, prompts(3) + prompts(9)[3:])
    for a, m in zip(alone, mixed[:3], strict=True):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids
    for (kind, _), out in zip(constrained, mixed[3:], strict=True):
        check_output(kind, out.outputs[0].text)


def test_constrained_tokens_survive_chunking_and_preemption(llm):
    """The same tokens with chunked prefill and a KV cache small enough to preempt."""
    reqs = [r for r in requests() if r[1].n == 1]
    reference = run(llm, reqs)
    llm.engine.reconfigure(enable_chunked_prefill=True, max_num_batched_tokens=8, num_kv_blocks=40)
    try:
        preemptions = llm.engine.stats().num_preemptions
        squeezed = run(llm, reqs)
        assert llm.engine.stats().num_preemptions > preemptions  # the test means something
    finally:
        llm.engine.reconfigure()
    for ref, out in zip(reference, squeezed, strict=True):
        assert ref.outputs[0].token_ids == out.outputs[0].token_ids


def test_constraints_with_logprobs_penalties_and_stop_strings(llm):
    reqs = [
        ("json", constraint(structured_outputs=SPECS["json"], logprobs=3)),
        (
            "regex",
            constraint(
                structured_outputs=SPECS["regex"],
                repetition_penalty=1.3,
                presence_penalty=0.5,
                temperature=0.9,
                seed=3,
            ),
        ),
    ]
    outs = run(llm, reqs)
    for (kind, _), out in zip(reqs, outs, strict=True):
        check_output(kind, out.outputs[0].text)
    sample = outs[0].outputs[0]
    assert len(sample.logprobs) == len(sample.token_ids)
    # Past the end of its constraint, a sequence that ignores EOS only stops again.
    (out,) = llm.generate(
        [{"prompt_token_ids": [5, 6]}],
        constraint(structured_outputs=SPECS["choice"], ignore_eos=True, max_tokens=12),
        use_tqdm=False,
    )
    eos = llm.engine.eos_token_ids
    sample = out.outputs[0]
    assert sample.text in CHOICES and sample.finish_reason == "length"
    assert sample.token_ids[-3:] and set(sample.token_ids[-3:]) <= set(eos)
    # A stop string inside a constrained output ends it there.
    literal = constraint(structured_outputs={"regex": "hello world, bye"}, stop=[","])
    (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], literal, use_tqdm=False)
    assert out.outputs[0].text == "hello world"
    assert out.outputs[0].stop_reason == ","


def test_a_bad_constraint_is_refused_and_nothing_else_is_lost(llm):
    bad = constraint(structured_outputs={"regex": "(unclosed"})
    good = constraint(structured_outputs=SPECS["choice"])
    with pytest.raises(ValueError, match=r"structured_outputs\.regex is not valid"):
        llm.generate([{"prompt_token_ids": [1, 2]}] * 2, [good, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished()
    (out,) = llm.generate([{"prompt_token_ids": [1, 2]}], good, use_tqdm=False)
    check_output("choice", out.outputs[0].text)


def test_compiling_holds_only_its_own_request(llm, monkeypatch):
    """A request waits for its grammar while the others run."""
    engine = llm.engine
    release = threading.Event()
    compile_ = engine.core.grammars._compile

    def slow_compile(kind, text):
        release.wait(timeout=60)
        return compile_(kind, text)

    monkeypatch.setattr(engine.core.grammars, "_compile", slow_compile)
    schema = {"type": "object", "properties": {"slow": {"type": "boolean"}}, "required": ["slow"]}
    engine.add_request("slow", [3, 4, 5], constraint(structured_outputs={"json": schema}))
    engine.add_request("free", [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=8))
    finished = {}
    try:
        for _ in range(50):
            for out in engine.step().outputs:
                if out.finish_reason is not None:
                    finished[out.seq_id] = out
            if "free" in finished:
                break
        assert "free" in finished and "slow" not in finished
        assert engine.stats().num_waiting == 1
    finally:
        release.set()
    tokens = []
    while engine.has_unfinished():
        for out in engine.step().outputs:
            tokens += out.new_token_ids
    text = llm.tokenizer.decode(tokens, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), schema)


# -- after the thinking --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """A model that thinks ("<think>", "ponder", "</think>") and then wants to say "maybe"."""
    script = Script("<s:think>", (THINK, "ponder", END_THINK, "maybe", IM_END))
    model_dir = build_scripted_checkpoint(tmp_path_factory.mktemp("scripted"), [script])
    engine = LLM(str(model_dir), max_model_len=512, num_kv_blocks=64, block_size=16)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "thinking-off"])
def test_the_constraint_applies_after_the_thinking(scripted, thinking):
    tok = scripted.tokenizer
    messages = [{"role": "user", "content": "<s:think> well?"}]
    text = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, enable_thinking=thinking
    )
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    think, end_think = tok.convert_tokens_to_ids([THINK, END_THINK])
    params = constraint(
        structured_outputs={"choice": ["yes", "no"]},
        think_start_token_id=think,
        think_end_token_id=end_think,
        skip_special_tokens=False,
    )
    (free,) = scripted.generate([{"prompt_token_ids": prompt}], constraint(), use_tqdm=False)
    (out,) = scripted.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    text = out.outputs[0].text
    if thinking:
        # The model thinks as it would unconstrained, then answers within the constraint.
        assert free.outputs[0].text.startswith(f"{THINK}ponder{END_THINK}maybe")
        assert text.startswith(f"{THINK}ponder{END_THINK}")
        assert text.removeprefix(f"{THINK}ponder{END_THINK}") in ("yes", "no")
    else:
        assert text in ("yes", "no")
    assert out.outputs[0].finish_reason == "stop"


def test_a_compilation_that_finished_late_is_a_timeout_whenever_the_engine_looks():
    """The verdict compares when the compilation finished with the deadline: an engine that
    looks only after a late finish (a long step, a compile thread holding the GIL) still
    answers the timeout, and one that finished in time is served however late it is seen."""
    from concurrent.futures import Future

    from tp_engine.features.structured.grammar import _stamp_finish, compile_verdict

    def compiled(result=None, error=None, late: bool = False) -> tuple[Future, float]:
        future: Future = Future()
        future.add_done_callback(_stamp_finish)
        deadline = time.monotonic() + (-0.001 if late else 60.0)
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
        return future, deadline

    assert compile_verdict(*compiled("g"), 0.3) == (True, None)
    settled, why = compile_verdict(*compiled("g", late=True), 0.3)
    assert settled and "did not compile within 0.3 s" in why
    settled, why = compile_verdict(*compiled(error=ValueError("bad")), 0.3)
    assert settled and why == "its output constraint failed to compile: bad"
    pending: Future = Future()
    assert compile_verdict(pending, time.monotonic() + 60.0, 0.3) == (False, None)
    settled, why = compile_verdict(pending, time.monotonic() - 1.0, 0.3)
    assert settled and "did not compile within" in why
