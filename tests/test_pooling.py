"""Pooling models end to end on CPU: Qwen3-Embedding and Qwen3-Reranker in their published
layouts (`tests/pooling_cases.py`), through `LLM.embed` / `LLM.score`, against the references
their model cards name (sentence-transformers; the reranker's formula with transformers).

Embeddings: queries with the instruction prompt and documents of mixed lengths in one batch,
under a 32-token budget (long prompts are prefilled in chunks), twice (the second pass starts
from the prefix cache), at TP 1 and 2; Matryoshka cuts equal sentence-transformers'
`truncate_dim` with normalisation. Reranker: both checkpoint forms (the causal LM with vLLM's
hf_overrides, the converted seq-cls one), tied and untied heads. And the refusals.
"""

from __future__ import annotations

import pytest
import torch

from tests.pooling_cases import (
    EMBED_QUERY_PROMPT,
    RERANKER_OVERRIDES,
    VLLM_EXAMPLE_DOCUMENTS,
    VLLM_EXAMPLE_INSTRUCTION,
    VLLM_EXAMPLE_QUERIES,
    build_embedding_checkpoint,
    build_reranker_checkpoint,
    convert_reranker_to_seq_cls,
    reranker_reference,
    sentence_transformers_vectors,
    vllm_formatted_pairs,
)
from tp_engine import LLM, LoRARequest, SamplingParams
from tp_engine.pooling_params import PoolingParams

pytestmark = pytest.mark.slow

COSINE_MIN = 0.99999
SCORE_TOL = 1e-5
ENGINE_ARGS = dict(
    block_size=4, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=32,
    enable_chunked_prefill=True, enable_prefix_caching=True,
)  # fmt: skip

QUERIES = ["what is a cache", "how do blocks share a prefix between two requests"]
DOCUMENTS = [
    "a",
    "The cache keeps the keys and values of every token that was already computed.",
    # Long documents sharing a 40-word beginning: chunked prefill, and prefix-cache hits.
    " ".join(["Once upon a time there was a quiet village by a river."] * 8) + " The end.",
    " ".join(["Once upon a time there was a quiet village by a river."] * 8) + " Or not.",
]


@pytest.fixture(scope="module")
def embed_case(tmp_path_factory):
    """The checkpoint and sentence-transformers' vectors: full, and cut to 16 dimensions."""
    from sentence_transformers import SentenceTransformer

    path = build_embedding_checkpoint(tmp_path_factory.mktemp("embed") / "qwen3-embedding")
    st = SentenceTransformer(str(path), device="cpu")

    def encode(**kw) -> torch.Tensor:
        return sentence_transformers_vectors(st, QUERIES, DOCUMENTS, **kw)

    return dict(
        path=path,
        full=encode(),
        cut16=encode(truncate_dim=16, normalize_embeddings=True),
        num_tokens=[len(st.tokenizer(t)["input_ids"]) for t in DOCUMENTS],
    )


def our_texts() -> list[str]:
    return [EMBED_QUERY_PROMPT + q for q in QUERIES] + DOCUMENTS


def assert_close_vectors(got: list[list[float]], want: torch.Tensor, what: str) -> None:
    got_t = torch.tensor(got)
    assert got_t.shape == want.shape, what
    cos = torch.nn.functional.cosine_similarity(got_t, want, dim=-1)
    assert cos.min() >= COSINE_MIN, f"{what}: cosines {cos.tolist()}"
    assert (got_t - want).abs().max() < 1e-4, what


@pytest.mark.parametrize("tp", [1, 2])
def test_embeddings_equal_sentence_transformers(embed_case, tp):
    # TP 1 serves the checkpoint as a Matryoshka model (through hf_overrides, as Qwen's card
    # says); TP 2 as published, which refuses `dimensions`.
    overrides = {"is_matryoshka": True} if tp == 1 else None
    llm = LLM(str(embed_case["path"]), tensor_parallel_size=tp, hf_overrides=overrides,
              **ENGINE_ARGS)  # fmt: skip
    try:
        assert llm.engine.model_spec.task == "embed"  # auto: modules.json
        assert max(embed_case["num_tokens"]) > 2 * ENGINE_ARGS["max_num_batched_tokens"]
        for attempt in ("cold", "prefix-cache hits"):
            outs = llm.embed(our_texts(), use_tqdm=False)
            assert_close_vectors([o.outputs.embedding for o in outs], embed_case["full"], attempt)
        stats = llm.engine.stats()
        assert stats.prefix_cache_hits > 0
        bm = llm.engine.core.scheduler.block_manager
        assert bm.usage == 0.0  # pooling requests free their blocks once done
        bm.check_integrity()
        # Token ids are taken verbatim: without the tokenizer's <|endoftext|> they differ.
        ids = llm.tokenizer(DOCUMENTS[1])["input_ids"]
        with_eot, without = llm.embed([ids, ids[:-1]], use_tqdm=False)
        assert with_eot.outputs.embedding == outs[3].outputs.embedding
        assert with_eot.outputs.embedding != without.outputs.embedding
        if tp == 1:
            cut = llm.embed(our_texts(), PoolingParams(dimensions=16), use_tqdm=False)
            assert_close_vectors([o.outputs.embedding for o in cut], embed_case["cut16"], "cut")
            with pytest.raises(ValueError, match=r"dimensions in range \[1, 64\]"):
                llm.embed("x", PoolingParams(dimensions=65), use_tqdm=False)
        else:
            with pytest.raises(ValueError, match="does not support Matryoshka"):
                llm.embed("x", PoolingParams(dimensions=16), use_tqdm=False)
            with pytest.raises(ValueError, match="generation is not supported for pooling"):
                llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)
            with pytest.raises(ValueError, match="Classify API is not supported"):
                llm.classify("x", use_tqdm=False)
            with pytest.raises(ValueError, match="LoRA adapters serve generation only"):
                adapter = LoRARequest("a", 1, str(embed_case["path"]))
                llm.engine.add_request("x", [1, 2], PoolingParams(), lora_request=adapter)
            # score on an embedding model: the cosine of the two embeddings.
            (score,) = llm.score(DOCUMENTS[2], DOCUMENTS[3], use_tqdm=False)
            a, b = embed_case["full"][4], embed_case["full"][5]
            cos = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
            assert abs(score.outputs.score - cos) < SCORE_TOL
    finally:
        llm.shutdown()


PAIRS_QUERY = "what is the capital of China?"
PAIRS_DOCS = [
    "The capital of China is Beijing.",
    "Gravity is a force that attracts two bodies towards each other.",
    " ".join(["A long passage about rivers and villages and markets."] * 6),
]


@pytest.fixture(scope="module")
def rerankers(tmp_path_factory):
    """Per head form: the original checkpoint, its seq-cls conversion, the card's scores."""
    root = tmp_path_factory.mktemp("rerank")
    out = {}
    for form, tied in (("tied", True), ("untied", False)):
        original = build_reranker_checkpoint(root / form, tied=tied, seed=21 + tied)
        seq_cls = convert_reranker_to_seq_cls(original, root / f"{form}-seq-cls")
        pairs = [(PAIRS_QUERY, d) for d in PAIRS_DOCS]
        vllm_pairs = list(zip(VLLM_EXAMPLE_QUERIES, VLLM_EXAMPLE_DOCUMENTS, strict=True))
        out[form] = dict(
            original=original,
            seq_cls=seq_cls,
            ref=reranker_reference(original, pairs),
            vllm_ref=reranker_reference(original, vllm_pairs, VLLM_EXAMPLE_INSTRUCTION),
        )
    return out


@pytest.mark.parametrize("form", ["tied", "untied"])
def test_reranker_scores_equal_the_model_card(rerankers, form):
    case = rerankers[form]
    ref = torch.tensor(case["ref"])
    assert ref.max() - ref.min() > 1e-3, "scores must tell the documents apart"
    # The original form runs at TP 2 (its overrides and head reach the workers through the
    # bootstrap; the untied head is vocab-parallel). The seq-cls form runs the GPU's pipeline
    # on CPU: asynchronous scheduling (pooled rows recorded a step later), its data paths.
    gpu_like = dict(async_scheduling=True, gpu_data_paths=True)
    for kind, path, overrides, extra in (
        ("original", case["original"], RERANKER_OVERRIDES, {"tensor_parallel_size": 2}),
        ("seq-cls", case["seq_cls"], None, gpu_like),
    ):
        llm = LLM(str(path), hf_overrides=overrides, **ENGINE_ARGS, **extra)
        try:
            assert llm.engine.async_scheduling == (extra is gpu_like)
            head = llm.engine.model_spec.head.kind
            assert head == ("token_score" if kind == "original" else "seq_cls")
            outs = llm.score(PAIRS_QUERY, PAIRS_DOCS, use_tqdm=False)
            got = torch.tensor([o.outputs.score for o in outs])
            assert (got - ref).abs().max() <= SCORE_TOL, f"{kind}: {got} vs {ref}"
            # vLLM's example formats the texts itself: scored as they are, they equal the
            # card's formula on the raw texts (wrapped a second time, they did not).
            queries, docs = vllm_formatted_pairs(VLLM_EXAMPLE_QUERIES, VLLM_EXAMPLE_DOCUMENTS)
            outs = llm.score(queries, docs, use_tqdm=False)
            got = torch.tensor([o.outputs.score for o in outs])
            want = torch.tensor(case["vllm_ref"])
            assert (got - want).abs().max() <= SCORE_TOL, f"{kind}, vLLM's form: {got} vs {want}"
            with pytest.raises(ValueError, match="already carry the reranker's template"):
                llm.score(queries, docs, instruction="x", use_tqdm=False)
            (probs,) = llm.classify("a", use_tqdm=False)
            assert probs.outputs.num_classes == 1
        finally:
            llm.shutdown()


def test_generate_model_refuses_pooling(rerankers):
    """The reranker's causal LM without overrides is a generate model."""
    llm = LLM(str(rerankers["untied"]["original"]), **ENGINE_ARGS)
    try:
        assert llm.engine.model_spec.task == "generate"
        with pytest.raises(ValueError, match="only supported for pooling models"):
            llm.embed("x", use_tqdm=False)
        assert llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    finally:
        llm.shutdown()


def test_sentence_transformers_6_layout(embed_case, tmp_path):
    """The same model re-saved by sentence-transformers 6 (new module names, a pooling_mode
    string, architecture `Qwen3Model`) serves the same vectors."""
    from sentence_transformers import SentenceTransformer

    saved = tmp_path / "st6"
    SentenceTransformer(str(embed_case["path"]), device="cpu").save(str(saved))
    assert "lasttoken" in (saved / "1_Pooling" / "config.json").read_text()
    llm = LLM(str(saved), **ENGINE_ARGS)
    try:
        assert llm.engine.model_spec.normalize
        outs = llm.embed(our_texts(), use_tqdm=False)
        assert_close_vectors([o.outputs.embedding for o in outs], embed_case["full"], "st6")
    finally:
        llm.shutdown()
