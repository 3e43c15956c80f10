"""Speculative decoding (n-gram proposals): the proposer, verification, the scheduler's rollback
and the engine end to end against transformers at TP 1, 2 and 4.

Verification samples every verified position as the non-speculative run samples that output
position (same processors, same counter-based noise), so greedy and seeded outputs must be token
for token those without speculation; the statistical test checks the rule itself (accept the
draft iff the target's draw equals it) against the target's distribution.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tp_cases import MAX_MODEL_LEN, build_checkpoints, hf_greedy
from tp_engine import LLM, SamplingParams
from tp_engine.config import EngineConfig
from tp_engine.features.speculative import (
    NgramProposer,
    SpecDecodeStats,
    SpeculativeConfig,
    accept_drafts,
)
from tp_engine.features.speculative.ngram import longest_suffix_match
from tp_engine.frontend.detokenizer import IncrementalDetokenizer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}

# -- the proposer -----------------------------------------------------------------------------


def test_longest_suffix_match_takes_the_longest_then_the_latest():
    t = np.array([5, 1, 2, 3, 9, 2, 3, 7, 1, 2, 3])
    # Suffix [1, 2, 3] occurred ending at 3; [2, 3] also at 6, but the longer match wins.
    assert longest_suffix_match(t, 1, 3) == (3, 3)
    assert longest_suffix_match(t, 1, 2) == (6, 2)  # capped at 2: the latest copy of [2, 3]
    assert longest_suffix_match(t, 4, 5) == (-1, 0)  # nothing of 4 tokens repeats
    assert longest_suffix_match(np.array([4, 4]), 1, 3) == (0, 1)
    assert longest_suffix_match(np.array([4]), 1, 3) == (-1, 0)
    assert longest_suffix_match(np.array([1, 2, 3]), 1, 3) == (-1, 0)


class _Seq:
    def __init__(self, tokens):
        self.token_ids = list(tokens)

    @property
    def num_tokens(self):
        return len(self.token_ids)


def test_ngram_proposer_follows_appended_tokens_and_limits():
    p = NgramProposer(k=3, min_n=1, max_n=3)
    a, b = _Seq([1, 2, 3, 4, 1, 2]), _Seq([7, 8, 9])
    p.add_row(0, a)
    p.add_row(1, b)
    drafts, num = p.propose(np.array([0, 1]), np.array([3, 3]))
    assert num.tolist() == [3, 0] and drafts.tolist() == [3, 4, 1]  # what followed [1, 2]
    a.token_ids += [3, 4, 1, 2]  # appended since: the proposer extends its array
    drafts, num = p.propose(np.array([0]), np.array([2]))
    assert num.tolist() == [2] and drafts.tolist() == [3, 4]
    drafts, num = p.propose(np.array([0]), np.array([0]))
    assert num.tolist() == [0] and drafts.size == 0
    assert p.eligible(np.array([0, 1])).tolist() == [True, True]
    p.may_draft = lambda rows: np.zeros(rows.size, dtype=bool)
    assert p.eligible(np.array([0, 1])).tolist() == [False, False]


# -- verification ---------------------------------------------------------------------------------


def test_accept_drafts_emits_the_accepted_prefix_and_the_targets_next():
    # Entries: 2 drafts, all accepted; 3 drafts, the second rejected; no drafts.
    sampled = np.array([10, 11, 12, 20, 29, 22, 23, 30])
    drafts = np.array([10, 11, 20, 21, 22])
    v = accept_drafts(sampled, np.array([2, 3, 0]), drafts)
    assert v.num_accepted.tolist() == [2, 1, 0]
    assert v.num_emitted.tolist() == [3, 2, 1]
    assert v.token_ids.tolist() == [10, 11, 12, 20, 29, 30]
    assert v.rows.tolist() == [0, 1, 2, 3, 4, 7]
    # The first draft rejected: only the target's own token.
    v = accept_drafts(np.array([5, 6]), np.array([1]), np.array([4]))
    assert v.token_ids.tolist() == [5] and v.num_accepted.tolist() == [0]


def test_spec_decode_stats_count_per_position():
    stats = SpecDecodeStats()
    # Entries: 3 drafts all output (4 tokens), 2 drafts and 1 output, no drafts.
    stats.record(np.array([3, 2, 0]), np.array([4, 2, 1]), k=3)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 5, 4)
    assert stats.accepted_per_pos == [2, 1, 1]
    assert stats.mean_acceptance_length == 3.0


def test_spec_decode_stats_count_only_drafts_that_became_output():
    """A run of 3 accepted drafts whose second token stopped its sequence gave 1 draft to the
    output; an entry whose sequence stopped running before the step was applied (0 tokens
    appended) counts for nothing, not even as a draft."""
    stats = SpecDecodeStats()
    stats.record(np.array([3, 2, 2]), np.array([2, 0, 3]), k=3)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 5, 3)
    assert stats.accepted_per_pos == [2, 1, 0]
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens


def test_verification_keeps_the_target_distribution():
    """The first emitted token of a verify entry, over many seeds, against the target's
    probabilities (temperature 0.7, top-k 6 of a 12-token vocabulary), for a likely draft, an
    unlikely one and one the truncation drops."""
    from tp_engine.core.sampling import process_logits, sample_batch
    from tp_engine.core.sampling.groups import cpu_put, plan_groups
    from tp_engine.core.sampling.tensors import SamplingMetadata

    vocab, num = 12, 6000
    g = torch.Generator().manual_seed(3)
    row = torch.randn(vocab, generator=g) * 2
    logits = row.expand(num, vocab).contiguous()

    def metadata(seeds):
        n = seeds.size
        return SamplingMetadata(
            num_rows=n,
            groups=plan_groups(
                cpu_put(logits.device), vocab,
                temperature=np.full(n, 0.7, dtype=np.float32), seeds=seeds,
                counters=np.zeros(n, dtype=np.int64), top_k=np.full(n, 6),
                top_p=np.ones(n, dtype=np.float32),
            ),
        )  # fmt: skip

    seeds = np.arange(num, dtype=np.int64) * 7919 + 11
    md = metadata(seeds)
    probs = torch.softmax(process_logits(logits[:1], metadata(seeds[:1])), dim=-1)[0].numpy()
    order = np.argsort(-probs)
    sampled = sample_batch(logits, md).token_ids.numpy()
    for draft in (int(order[0]), int(order[4]), int(order[-1])):
        # One verify entry per seed: [row of y_0, row of y_1]; only y_0 matters here.
        pairs = np.stack([sampled, sampled], axis=1).reshape(-1)
        v = accept_drafts(pairs, np.ones(num, dtype=np.int32), np.full(num, draft))
        first = v.token_ids[np.concatenate([[0], np.cumsum(v.num_emitted)[:-1]])]
        freq = np.bincount(first, minlength=vocab) / num
        accept_rate = float(np.mean(v.num_accepted))
        assert (
            abs(accept_rate - probs[draft])
            < 4 * np.sqrt(probs[draft] * (1 - probs[draft]) / num) + 1e-3
        )
        kept = probs > 0
        expected = probs[kept] * num
        chi2 = float((((freq[kept] * num) - expected) ** 2 / expected).sum())
        # 5 degrees of freedom: P(chi2 > 25) < 2e-4.
        assert chi2 < 25, (draft, chi2, freq, probs)
        assert freq[~kept].sum() == 0


# -- configuration ----------------------------------------------------------------------------------


def test_speculative_config_is_checked():
    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max, spec.k) == (1, 5, 4)
    assert SpeculativeConfig.parse({**NGRAM, "prompt_lookup_min": 2}).prompt_lookup_min == 2
    for bad, match in [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        ({**NGRAM, "num_speculative_tokens": 0}, r"in \[1, 64\]"),
        ({**NGRAM, "prompt_lookup_min": 4}, "prompt_lookup_min <= prompt_lookup_max"),
        ({**NGRAM, "foo": 1}, "unknown keys"),
        ("{not json", "not valid JSON"),
    ]:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="async_scheduling cannot be on"):
        EngineConfig(speculative_config=NGRAM, async_scheduling=True)
    with pytest.raises(ValueError, match='"draft_model" needs "model"'):
        EngineConfig(speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    assert EngineConfig(speculative_config=NGRAM).speculative_config == SpeculativeConfig.parse(
        NGRAM
    )


def test_detokenizer_stops_within_a_multi_token_update():
    from transformers import AutoTokenizer

    from tp_engine.demo import demo_checkpoint_dir

    tok = AutoTokenizer.from_pretrained(str(demo_checkpoint_dir()))
    ids = tok("hello there world again")["input_ids"]
    text = tok.decode(ids)
    stop = text[len(tok.decode(ids[:2])) : len(tok.decode(ids[:3]))].strip()[:3]
    one = IncrementalDetokenizer(tok, stop=[stop])
    for i in ids:
        one.update([i], engine_stopped=False, finished=False)
        if one.finished:
            break
    many = IncrementalDetokenizer(tok, stop=[stop])
    many.update(ids, engine_stopped=False, finished=False)
    assert many.finished and many.stop_string == stop
    assert many.token_ids == one.token_ids and many.text == one.text
    assert len(many.token_ids) < len(ids)


# -- end to end ---------------------------------------------------------------------------------

MAX_TOKENS = 20
CKPT = "tied_kv2_oddvocab"


def make_prompts(vocab_size: int) -> list[list[int]]:
    """Prompts that repeat a passage (n-gram lookup finds drafts) and some that do not."""
    g = torch.Generator().manual_seed(5)
    rand = lambda n: torch.randint(0, vocab_size, (n,), generator=g).tolist()  # noqa: E731
    passages = [rand(n) for n in (4, 6, 8, 10)]
    repeated = [p * 3 for p in passages] + [passages[0] * 2 + rand(3)]
    return repeated + [rand(n) for n in (1, 5, 17, 30)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_checkpoints(tmp_path_factory.mktemp("ckpt"))[CKPT]


def hf_greedy_reference(checkpoint: Path) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts and transformers' greedy continuations of them."""
    prompts = make_prompts(643)  # the test tokenizer's size, the checkpoint's vocabulary
    return prompts, hf_greedy(checkpoint, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def reference(checkpoint) -> tuple[list[list[int]], list[list[int]]]:
    return hf_greedy_reference(checkpoint)


def _llm(checkpoint: Path, tp: int, spec: dict | None) -> LLM:
    return LLM(
        str(checkpoint), tensor_parallel_size=tp, block_size=4, num_kv_blocks=128,
        max_num_seqs=8, max_num_batched_tokens=MAX_MODEL_LEN, speculative_config=spec,
    )  # fmt: skip


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda tp: f"tp{tp}")
def spec_llm(request, checkpoint):
    engine = _llm(checkpoint, request.param, NGRAM)
    yield engine
    engine.shutdown()


def check_matches_hf(llm: LLM, reference, **knobs) -> None:
    prompts, expected = reference
    llm.engine.reconfigure(**knobs)
    before = llm.engine.spec_stats.num_drafts
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    for i, (o, e) in enumerate(zip(outs, expected, strict=True)):
        assert o.outputs[0].token_ids == e, f"prompt {i}: engine {o.outputs[0].token_ids} != {e}"
    assert llm.engine.spec_stats.num_drafts > before, "no step verified a draft"
    bm = llm.engine.core.scheduler.block_manager
    assert bm.usage == 0.0
    bm.check_integrity()


@pytest.mark.slow
@pytest.mark.parametrize(
    "knobs",
    [
        {"enable_prefix_caching": True, "enable_chunked_prefill": True},
        {"enable_prefix_caching": False, "enable_chunked_prefill": False},
        {"max_num_batched_tokens": 8, "max_num_seqs": 4},
        {"num_kv_blocks": 16},
    ],
    ids=["prefix_chunked", "neither", "small_budget", "small_pool"],
)
def test_greedy_equals_transformers_with_ngram_speculation(spec_llm, reference, knobs):
    check_matches_hf(spec_llm, reference, **knobs)
    if "num_kv_blocks" in knobs:
        assert spec_llm.engine.core.scheduler.num_preemptions > 0
    stats = spec_llm.engine.spec_stats
    # Both outcomes happened: accepted drafts and rejected ones.
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
