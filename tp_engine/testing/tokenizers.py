"""Tokenizers for local checkpoints: a small BPE trained here, and Qwen3's own rebuilt from
Qwen's published BPE ranks (shipped inside the `dashscope` package), both saved with Qwen's
special tokens and a ChatML chat template."""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# ChatML, as Qwen writes it (without the tool-calling branches).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# A few paragraphs of plain English for the BPE merges. The tokenizer is byte-level, so any
# text round-trips whatever the corpus; the corpus only decides which byte runs get merged.
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A serving engine answers many requests at "
    "once: it batches the prompts that arrive, runs the model on all of them together, and "
    "streams each answer back as soon as a new token is ready.",
    "Tensor parallelism splits every layer of a large language model across several devices. "
    "Each device holds a slice of every weight matrix, computes its part of the result, and the "
    "devices then add their partial results together before the next layer begins.",
    "Hello, world! How are you today? I am fine, thank you. What would you like to talk about? "
    "Tell me a story about a small robot that learned to paint the sea at sunset.",
    "The cache keeps the keys and values of every token that was already computed, in blocks of "
    "a fixed size. When two requests share the same beginning, they can share the same blocks, "
    "and the second request starts where the first one left off.",
    "Numbers and symbols appear in text too: 0 1 2 3 4 5 6 7 8 9, 10, 42, 100, 2024, 3.14, "
    "(a + b) * c = d; x[i] = y{j}; \"quoted\" and 'single' marks; e-mail@example.com; #tag.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, i))\n",
    "Once upon a time there was a quiet village by a river. Every morning the people walked to "
    "the market, and every evening they came home, told each other what they had seen, and "
    "went to sleep under the bright stars of the summer sky.",
)
_TOKENIZER_VOCAB = 640


def build_tokenizer(out_dir: str | Path) -> Any:
    """Train a small byte-level BPE tokenizer and save it to `out_dir` with Qwen's special
    tokens, eos `<|im_end|>`, pad `<|endoftext|>` and a ChatML chat template.

    Deterministic: the same corpus and settings give the same merges on every machine. Returns
    the `transformers` tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Byte-level, no prefix space, GPT-2's split regex: every byte sequence has an encoding.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TOKENIZER_VOCAB,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS), trainer=trainer)
    # Added after training, so they sit at the end of the vocabulary as in Qwen's.
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(str(out_dir))
    return hf_tok


# Qwen3's tokenizer, rebuilt from Qwen's published BPE ranks: the 151,643 byte-level tokens of
# `qwen.tiktoken` (shipped inside the `dashscope` package), Qwen2's pre-tokenizer split (single
# digits, unlike tiktoken's cl100k) behind NFC, and Qwen3's 26 added tokens at their public ids.
# 151,669 tokens in all, under the 151,936 rows of Qwen3's embedding, as in the real checkpoints.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (  # (content, special), ids from 151643 on
    (ENDOFTEXT, True), (IM_START, True), (IM_END, True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True),
    ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", True), ("<|fim_middle|>", True), ("<|fim_suffix|>", True),
    ("<|fim_pad|>", True), ("<|repo_name|>", True), ("<|file_sep|>", True),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)  # fmt: skip
QWEN3_TOKENIZER_SIZE = 151_669
QWEN3_VOCAB_ROWS = 151_936


def qwen_tiktoken_path() -> Path:
    """`dashscope`'s copy of Qwen's BPE ranks, found without importing the package (whose
    import pulls in its HTTP client)."""
    import importlib.util

    spec = importlib.util.find_spec("dashscope")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the Qwen3 tokenizer is built from Qwen's BPE ranks in the 'dashscope' package "
            "(resources/qwen.tiktoken): pip install dashscope"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: this dashscope release does not ship qwen.tiktoken")
    return path


def build_qwen3_tokenizer(out_dir: str | Path) -> Any:
    """Qwen3's tokenizer (see QWEN3_ADDED_TOKENS) saved to `out_dir` with eos `<|im_end|>`, pad
    `<|endoftext|>` and the ChatML chat template; about 2 s. Returns the `transformers`
    tokenizer. "Hello" encodes to 9707 as in Qwen3."""
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class QwenRanks(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(path: str) -> dict[bytes, int]:
            # One "base64-token rank" pair a line; read here so that tiktoken is not needed.
            with open(path, "rb") as f:
                return {
                    base64.b64decode(t): int(r) for t, r in (ln.split() for ln in f if ln.strip())
                }

    tok = QwenRanks(vocab_file=str(qwen_tiktoken_path()), pattern=QWEN2_SPLIT_PATTERN).converted()
    tok.normalizer = normalizers.NFC()
    for content, special in QWEN3_ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    if tok.get_vocab_size() != QWEN3_TOKENIZER_SIZE:
        raise ValueError(f"built {tok.get_vocab_size()} tokens, expected {QWEN3_TOKENIZER_SIZE}")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[c for c, special in QWEN3_ADDED_TOKENS[1:] if special],
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(str(out_dir))
    return hf_tok


TOKENIZERS: dict[str, Callable[[str | Path], Any]] = {
    "test": build_tokenizer,
    "qwen3": build_qwen3_tokenizer,
}
