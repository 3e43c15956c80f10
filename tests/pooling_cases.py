"""Tiny pooling checkpoints in the layouts Qwen publishes, and their references.

- `build_embedding_checkpoint`: Qwen3-Embedding as on the hub: flat tensor names (no `model.`
  prefix), no `lm_head`, a tokenizer whose post-processor appends `<|endoftext|>` (also its pad
  token), and sentence-transformers' files in their <= 5 spelling (modules.json, a last-token
  `1_Pooling`, `2_Normalize`, the query prompt). `SentenceTransformer(dir)` loads it: the
  reference.
- `build_reranker_checkpoint`: Qwen3-Reranker as on the hub: a causal LM (tied or untied head)
  whose tokenizer has "no" and "yes" as single tokens and appends nothing. Served with
  `RERANKER_OVERRIDES`, as vLLM serves it.
- `convert_reranker_to_seq_cls`: the same model as a `Qwen3ForSequenceClassification` with one
  label, `score.weight = W[yes] - W[no]` (what vLLM's `convert_model_to_seq_cls.py` and
  tomaarsen's `*-seq-cls` checkpoints do).
- `reranker_reference`: the model card's formula with transformers.
- `VLLM_EXAMPLE_*`, `vllm_formatted_pairs`: vLLM's own Qwen3-Reranker example, whose texts carry
  the template already.

The server tests import these too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tp_engine.testing.pooling_checkpoints import (  # noqa: F401 - re-exported for the tests
    EMBED_QUERY_PROMPT,
    RERANKER_OVERRIDES,
    append_endoftext,
    write_sentence_transformers_files,
)

_SMALL = dict(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, max_position_embeddings=512,
)  # fmt: skip


# vLLM's documented way to call Qwen3-Reranker (vllm-project/vllm,
# examples/offline_inference/qwen3_reranker.py; vLLM-Ascend's tutorial and most user code copy
# it): the sender formats each query as prefix + "<Instruct>: ...\n<Query>: ...\n" and each
# document as "<Document>: ..." + suffix, and passes those texts to `LLM.score` or `/score`.
# The strings below are that example's, reproduced (not imported: vLLM is not installed here).
VLLM_EXAMPLE_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".'
    "<|im_end|>\n<|im_start|>user\n"
)
VLLM_EXAMPLE_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
VLLM_EXAMPLE_INSTRUCTION = (
    "Given a web search query, retrieve relevant passages that answer the query"
)
VLLM_EXAMPLE_QUERIES = ["What is the capital of China?", "Explain gravity"]
VLLM_EXAMPLE_DOCUMENTS = [
    "The capital of China is Beijing.",
    "Gravity is a force that attracts two bodies towards each other. It gives weight to "
    "physical objects and is responsible for the movement of planets around the sun.",
]
VLLM_QUERY_TEMPLATE = "{prefix}<Instruct>: {instruction}\n<Query>: {query}\n"
VLLM_DOCUMENT_TEMPLATE = "<Document>: {doc}{suffix}"


def vllm_formatted_pairs(
    queries: list[str], documents: list[str], instruction: str = VLLM_EXAMPLE_INSTRUCTION
) -> tuple[list[str], list[str]]:
    """The texts the vLLM example sends for these queries and documents."""
    formatted_queries = [
        VLLM_QUERY_TEMPLATE.format(prefix=VLLM_EXAMPLE_PREFIX, instruction=instruction, query=q)
        for q in queries
    ]
    formatted_docs = [
        VLLM_DOCUMENT_TEMPLATE.format(doc=d, suffix=VLLM_EXAMPLE_SUFFIX) for d in documents
    ]
    return formatted_queries, formatted_docs


def build_embedding_checkpoint(out_dir: Path, *, seed: int = 11) -> Path:
    """A random Qwen3-Embedding in the published layout (module docstring)."""
    from tp_engine.testing import build_random_qwen3, rewrite_checkpoint

    src = build_random_qwen3(out_dir.with_name(out_dir.name + "-src"), seed=seed,
                             tie_word_embeddings=True, **_SMALL)  # fmt: skip

    def flat(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        return {} if name == "lm_head.weight" else {name.removeprefix("model."): t}

    out = rewrite_checkpoint(src, out_dir, flat, lambda config: None)
    append_endoftext(out)
    write_sentence_transformers_files(out, hidden_size=_SMALL["hidden_size"])
    return out


def build_reranker_checkpoint(out_dir: Path, *, tied: bool, seed: int = 21) -> Path:
    """A random Qwen3-Reranker: a causal LM whose tokenizer knows "no" and "yes" as tokens
    (added after the test vocabulary, inside the padded embedding)."""
    from transformers import AutoTokenizer

    from tp_engine.testing import build_random_qwen3

    out = build_random_qwen3(out_dir, seed=seed, tie_word_embeddings=tied, vocab_size=648,
                             **_SMALL)  # fmt: skip
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_tokens(["no", "yes"])
    tok.save_pretrained(out)
    return out


def convert_reranker_to_seq_cls(src: Path, out_dir: Path) -> Path:
    """`src` (a `build_reranker_checkpoint`) as a one-label seq-cls checkpoint."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from tp_engine.testing import rewrite_checkpoint

    tok = AutoTokenizer.from_pretrained(src)
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    weights = load_file(src / "model.safetensors")
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    score = (head[yes].float() - head[no].float()).unsqueeze(0)  # [1, hidden]

    def convert(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if name == "lm_head.weight":
            return {}
        out = {name: t}
        if name == "model.embed_tokens.weight":
            out["score.weight"] = score.to(t.dtype)
        return out

    def edit(config: dict) -> None:
        config["architectures"] = ["Qwen3ForSequenceClassification"]
        config["num_labels"] = 1
        config["id2label"] = {"0": "LABEL_0"}
        config["label2id"] = {"LABEL_0": 0}

    return rewrite_checkpoint(src, out_dir, convert, edit)


def reranker_reference(model_dir: Path, pairs: list[tuple[str, str]], instruction=None):
    """The model card's score of each (query, document) with transformers in fp32: the last
    position's logits, log_softmax over [no, yes], exp of yes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tp_engine.features.pooling.rerank_prompt import rerank_prompt_parts

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    scores = []
    with torch.no_grad():
        for query, doc in pairs:
            prefix, body, suffix = rerank_prompt_parts(query, doc, instruction)
            ids = [
                t
                for part in (prefix, body, suffix)
                for t in tok.encode(part, add_special_tokens=False)
            ]
            logits = model(torch.tensor([ids])).logits[0, -1]
            pair = torch.stack([logits[no], logits[yes]])
            scores.append(torch.log_softmax(pair, dim=0)[1].exp().item())
    return scores


def sentence_transformers_vectors(
    st: Any, queries: list[str], documents: list[str], **kw: Any
) -> torch.Tensor:
    """The reference: sentence-transformers' `encode` of `queries` under the model's query
    prompt, then of `documents` (`kw`: e.g. `truncate_dim`, `normalize_embeddings`)."""
    found = st.encode(queries, prompt_name="query", convert_to_tensor=True, **kw)
    return torch.cat([found, st.encode(documents, convert_to_tensor=True, **kw)])
