"""Pooling checkpoints in the layouts Qwen publishes, made from any Qwen3 checkpoint (the tests'
tiny ones, and `launch/demo_assets.py`'s demo embedder and reranker made from the demo model).

    embedding_layout(src, out)   Qwen3-Embedding as on the hub: flat tensor names (no `model.`
                                 prefix), no `lm_head`, a tokenizer that appends
                                 `<|endoftext|>`, sentence-transformers' files (modules.json, a
                                 last-token `1_Pooling`, `2_Normalize`, the query prompt), so
                                 the engine detects an embedding model and
                                 `SentenceTransformer(out)` loads it as the reference
    reranker_layout(src, out)    Qwen3-Reranker as on the hub: a causal LM whose tokenizer has
                                 "no" and "yes" as single tokens (appended, with their rows in
                                 the embedding and head), served with `RERANKER_OVERRIDES`

Nothing here downloads; the weights are whatever `src` holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# The query prompt of Qwen3-Embedding's sentence-transformers config (its web-search task).
EMBED_QUERY_PROMPT = (
    "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
)
# How vLLM (and this engine) serve the original Qwen3-Reranker: as a one-label classifier whose
# score is sigmoid(logit("yes") - logit("no")).
RERANKER_OVERRIDES = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}
_ENDOFTEXT = "<|endoftext|>"


def embedding_layout(src: Path, out: Path) -> Path:
    """`src` (a Qwen3 causal LM) rewritten as Qwen3-Embedding is published (module
    docstring)."""
    from tp_engine.testing import rewrite_checkpoint

    def flat(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        return {} if name == "lm_head.weight" else {name.removeprefix("model."): t}

    def no_head(config: dict) -> None:
        config["tie_word_embeddings"] = True  # no lm_head tensor: nothing to look for

    out = rewrite_checkpoint(src, out, flat, no_head)
    append_endoftext(out)
    hidden_size = json.loads((out / "config.json").read_text())["hidden_size"]
    write_sentence_transformers_files(out, hidden_size=hidden_size)
    return out


def append_endoftext(model_dir: Path) -> None:
    """Qwen3-Embedding's tokenizer.json: every encoding ends with `<|endoftext|>` (the token
    whose hidden state is the embedding)."""
    from tokenizers import Tokenizer, processors

    path = model_dir / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A:0 {_ENDOFTEXT}:0",
        pair=f"$A:0 {_ENDOFTEXT}:0 $B:1 {_ENDOFTEXT}:1",
        special_tokens=[(_ENDOFTEXT, tok.token_to_id(_ENDOFTEXT))],
    )
    tok.save(str(path))


def write_sentence_transformers_files(model_dir: Path, *, hidden_size: int) -> None:
    """sentence-transformers' files in their <= 5 spelling, as Qwen3-Embedding ships them."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (model_dir / "modules.json").write_text(json.dumps(modules, indent=2))
    pooling = {
        "word_embedding_dimension": hidden_size,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": True,
        "include_prompt": True,
    }
    (model_dir / "1_Pooling").mkdir(exist_ok=True)
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    (model_dir / "2_Normalize").mkdir(exist_ok=True)
    st_config = {
        "prompts": {"query": EMBED_QUERY_PROMPT, "document": ""},
        "default_prompt_name": None,
        "similarity_fn_name": "cosine",
    }
    (model_dir / "config_sentence_transformers.json").write_text(json.dumps(st_config, indent=2))
    (model_dir / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 512, "do_lower_case": False})
    )


def reranker_layout(src: Path, out: Path, *, seed: int = 0) -> Path:
    """`src` with "no" and "yes" added to its tokenizer where it lacks them, each new token a
    new row of the embedding (and of an untied head), random from `seed`."""
    from transformers import AutoTokenizer

    from tp_engine.testing import rewrite_checkpoint

    tok = AutoTokenizer.from_pretrained(src)
    vocab_size = json.loads((src / "config.json").read_text())["vocab_size"]
    tok.add_tokens([t for t in ("no", "yes") if t not in tok.get_vocab()])
    new_rows = max(0, len(tok) - vocab_size)
    generator = torch.Generator().manual_seed(seed)

    def grow(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if name in ("model.embed_tokens.weight", "lm_head.weight") and new_rows:
            rows = torch.randn(new_rows, t.shape[1], generator=generator) * t.float().std()
            t = torch.cat([t, rows.to(t.dtype)])
        return {name: t}

    def edit(config: dict) -> None:
        config["vocab_size"] = vocab_size + new_rows

    out = rewrite_checkpoint(src, out, grow, edit)
    tok.save_pretrained(out)
    return out
