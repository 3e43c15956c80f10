"""Qwen3's tokenizer rebuilt from Qwen's BPE ranks (`dashscope`'s qwen.tiktoken): the size and
ids of the real one, byte-level round trips, and the benchmark checkpoints that carry it."""

from __future__ import annotations

import random
import unicodedata
from pathlib import Path

import pytest

from tp_engine.testing import (
    QWEN3_ADDED_TOKENS,
    QWEN3_TOKENIZER_SIZE,
    QWEN3_VOCAB_ROWS,
    build_qwen3_tokenizer,
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3-tok")
    build_qwen3_tokenizer(out)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(out))  # as the engine loads it


def test_size_and_the_added_tokens_at_their_public_ids(tok) -> None:
    assert len(tok) == QWEN3_TOKENIZER_SIZE == 151_669 < QWEN3_VOCAB_ROWS
    ids = {content: 151_643 + i for i, (content, _) in enumerate(QWEN3_ADDED_TOKENS)}
    assert len(ids) == 26
    for content, want in ids.items():
        assert tok.convert_tokens_to_ids(content) == want, content
    assert (ids["<|endoftext|>"], ids["<|im_end|>"], ids["</think>"]) == (151643, 151645, 151668)
    assert tok.eos_token_id == 151645 and tok.pad_token_id == 151643


def test_ids_are_qwen3s(tok) -> None:
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    assert enc("Hello") == [9707]
    assert enc("Hello, world!") == [9707, 11, 1879, 0]
    assert enc("<|im_start|>user\n") == [151644, 872, 198]
    assert enc("<|im_start|>assistant\n") == [151644, 77091, 198]
    # Qwen2's split: one digit a token (cl100k's pattern would take three).
    assert len(enc("12345")) == 5
    # <think> is an added token but not a special one: it survives skip_special_tokens.
    ids = enc("<think>x</think>")
    assert ids[0] == 151667 and ids[-1] == 151668
    assert tok.decode(ids, skip_special_tokens=True) == "<think>x</think>"
    assert tok.decode(enc("<|im_end|>"), skip_special_tokens=True) == ""


def test_any_text_round_trips_byte_level(tok) -> None:
    rng = random.Random(0)
    pools = [
        "abcdefghijklmnopqrstuvwxyz ABC 0123456789 .,;:!?'\"()[]{}<>\n\t",
        "你好世界模型推理服务 こんにちは 안녕하세요 Привет мир",
        "😀🚀🧪👩‍💻 ∑∫√∞ éèçàü ñ",
    ]
    for _ in range(200):
        text = "".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 40)))
        ids = tok.encode(text, add_special_tokens=False)
        assert all(0 <= i < 151_643 for i in ids)  # no text becomes an added token
        assert tok.decode(ids) == unicodedata.normalize("NFC", text)
    # Random bytes (invalid UTF-8 included) pass through the byte-level alphabet too.
    raw = bytes(rng.randrange(256) for _ in range(300)).decode("utf-8", errors="replace")
    assert tok.decode(tok.encode(raw, add_special_tokens=False)) == unicodedata.normalize(
        "NFC", raw
    )


def test_size_presets_build_with_qwen3s_tokenizer(monkeypatch, tmp_path: Path) -> None:
    import benchmarks.models as models

    calls = []
    monkeypatch.setattr(
        models, "cached_random_qwen3", lambda name, **kw: calls.append((name, kw)) or tmp_path
    )
    for size in ("0.6B", "8B", "30B-A3B"):
        models.resolve_model(size)
    assert [kw["tokenizer"] for _, kw in calls] == ["qwen3"] * 3
    assert all(kw["vocab_size"] == QWEN3_VOCAB_ROWS for _, kw in calls)


def test_missing_dashscope_is_named(monkeypatch, tmp_path: Path) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "dashscope" else real(name, *a),
    )
    with pytest.raises(ModuleNotFoundError, match="pip install dashscope"):
        build_qwen3_tokenizer(tmp_path)
