"""YaRN end to end: `LLM.generate` on tiny checkpoints scaled by YaRN (factor 4 over a 32-token
pretraining length, so positions up to 128) against transformers (float32, CPU).

Dense and MoE, TP = 1 and 2, chunked prefill (a 16-token budget) and prefix caching: greedy
tokens equal transformers' on prompts longer than original_max_position_embeddings, and the
log-probabilities of every prompt and output position equal transformers' log-softmax. The
short prompt's log-probabilities also differ from the same weights without YaRN: the scaling is
static, at every position. Transformers is a stable reference here: it recomputes its rotary
table per forward, with no length limit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.moe_cases import MIN_ROUTER_MARGIN, MOE_CHECKPOINTS, hf_greedy, router_margins
from tests.tp_cases import CHECKPOINTS
from tp_engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

L0 = 32  # original_max_position_embeddings (and the config's max_position_embeddings)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L0}
MAX_POSITIONS = 128  # L0 × factor
MAX_TOKENS = 6
LOGPROB_TOL = 1e-4  # fp32; reordered TP sums move log-probabilities by ~1e-6


def make_prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    rand = lambda n: torch.randint(0, vocab_size, (n,), generator=g).tolist()  # noqa: E731
    shared = rand(44)  # 11 blocks of 4, past L0: the prefix cache holds YaRN-rotated K
    return [rand(10), rand(100), shared + rand(30), shared + rand(50)]


def load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, dict]:
    """Per model kind: the YaRN checkpoint, prompts, transformers' greedy continuations and its
    log-softmax over prompt + continuation, with and without YaRN."""
    from tp_engine.testing import build_random_qwen3, build_random_qwen3_moe, with_rope_scaling

    root = tmp_path_factory.mktemp("yarn")
    bases = {
        "dense": build_random_qwen3(
            root / "dense", max_position_embeddings=L0, rope_theta=1e4,
            **CHECKPOINTS["tied_kv2_oddvocab"],
        ),
        "moe": build_random_qwen3_moe(
            root / "moe", max_position_embeddings=L0, rope_theta=1e4, **MOE_CHECKPOINTS["moe_e6k2"]
        ),
    }  # fmt: skip
    out = {}
    for kind, base in bases.items():
        scaled = with_rope_scaling(base, root / f"{kind}_yarn", YARN)
        model, plain = load_hf(scaled), load_hf(base)
        prompts = make_prompts(model.config.vocab_size)
        expected = hf_greedy(model, prompts, MAX_TOKENS)
        full = [p + e for p, e in zip(prompts, expected, strict=True)]
        if kind == "moe":  # no routing near-tie to flip under TP reordering (tests/moe_cases.py)
            assert router_margins(model, full) > MIN_ROUTER_MARGIN
        with torch.no_grad():
            ref = [torch.log_softmax(model(torch.tensor([s])).logits[0], -1) for s in full]
            unscaled = [torch.log_softmax(plain(torch.tensor([s])).logits[0], -1) for s in full]
        out[kind] = dict(
            path=scaled, prompts=prompts, expected=expected, ref=ref, unscaled=unscaled
        )
    return out


@pytest.fixture(
    scope="module", params=[("dense", 1), ("dense", 2), ("moe", 1), ("moe", 2)], ids=str
)
def llm(request, cases):
    kind, tp = request.param
    engine = LLM(
        str(cases[kind]["path"]),
        tensor_parallel_size=tp,
        block_size=4,
        num_kv_blocks=160,
        max_num_seqs=8,
        max_num_batched_tokens=16,  # every long prompt is prefilled in chunks
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
    )
    engine.case = cases[kind]
    yield engine
    engine.shutdown()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


def test_default_max_len_is_original_times_factor(llm):
    assert llm.engine.config.max_model_len == MAX_POSITIONS
    rotary = llm.engine.runner.model.model.layers[0].self_attn.rotary
    assert rotary.cos_sin_cache.shape[0] == MAX_POSITIONS  # rank 0's table: the same bound


def test_greedy_equals_transformers_past_the_original_length(llm):
    case = llm.case
    requests = [{"prompt_token_ids": p} for p in case["prompts"]]
    for attempt in range(2):  # the second pass starts the shared prompts from the prefix cache
        outputs = llm.generate(requests, greedy(), use_tqdm=False)
        for i, (out, exp) in enumerate(zip(outputs, case["expected"], strict=True)):
            got = out.outputs[0].token_ids
            assert got == exp, f"pass {attempt}, prompt {i}: engine {got} != transformers {exp}"
    assert outputs[3].num_cached_tokens >= 44
    bm = llm.engine.core.scheduler.block_manager
    assert bm.usage == 0.0
    bm.check_integrity()


def test_logprobs_equal_transformers_at_every_position(llm):
    case = llm.case
    params = greedy(logprobs=2, prompt_logprobs=2)
    requests = [{"prompt_token_ids": p} for p in case["prompts"]]
    outputs = llm.generate(requests, params, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(case["prompts"], outputs, strict=True)):
        ref, unscaled = case["ref"][i], case["unscaled"][i]
        seq = prompt + out.outputs[0].token_ids
        # Row p - 1 predicts token p: prompt positions 1.., then every output token.
        rows = list(out.prompt_logprobs[1:]) + list(out.outputs[0].logprobs)
        got = torch.tensor([rows[p - 1][seq[p]].logprob for p in range(1, len(seq))])
        want = torch.stack([ref[p - 1, seq[p]] for p in range(1, len(seq))])
        err = (got - want).abs()
        assert err.max() < LOGPROB_TOL, f"prompt {i}: worst at position {int(err.argmax()) + 1}"
        for p in range(1, len(seq)):  # the top-2 tokens too
            top = torch.topk(ref[p - 1], 2)
            for rank, (t, lp) in enumerate(zip(top.indices.tolist(), top.values, strict=True)):
                entry = rows[p - 1][t]
                assert entry.rank == rank + 1 and abs(entry.logprob - lp) < LOGPROB_TOL
        # Static YaRN: positions below L0 differ from the same weights without it.
        head = min(len(seq), L0) - 1
        unscaled_lp = torch.stack([unscaled[p - 1, seq[p]] for p in range(1, head + 1)])
        assert (got[:head] - unscaled_lp).abs().max() > 1e-2, f"prompt {i} looks unscaled"
