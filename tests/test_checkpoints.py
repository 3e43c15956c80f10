"""Locally made checkpoints: the tokenizer round-trips, the chat template renders, transformers
loads the weights without complaint, and the random model is not degenerate."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from benchmarks.models import QWEN3_PRESETS
from tp_engine.demo import demo_checkpoint_dir
from tp_engine.testing import build_random_qwen3, build_tokenizer

TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
            intermediate_size=128, max_position_embeddings=128)  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return out


def test_tokenizer_round_trips_any_text(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert 400 <= len(tok) <= 1000
    for text in ["The quick brown fox.", "héllo wörld 日本語 🙂", "\t\n  spaces\r\n", "a" * 300,
                 "<|im_start|>user\nhi<|im_end|>", "\x00\x7f bytes"]:  # fmt: skip
        assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.convert_tokens_to_ids("<|im_start|>") != tok.unk_token_id
    # Special tokens are single ids, and merges make English shorter than its bytes.
    assert len(tok.encode("<|im_end|>")) == 1
    assert len(tok.encode("The serving engine answers many requests.")) < 25


def test_tokenizer_is_deterministic(tmp_path: Path, tokenizer_dir: Path) -> None:
    build_tokenizer(tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == (
        tokenizer_dir / "tokenizer.json"
    ).read_bytes()


def test_chat_template_renders_chatml(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages, tokenize=False).endswith("Hi!<|im_end|>\n")


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_transformers_loads_it_and_greedy_text_varies(tmp_path: Path, tied: bool) -> None:
    from transformers import AutoTokenizer, GenerationConfig, Qwen3ForCausalLM

    d = build_random_qwen3(tmp_path, tie_word_embeddings=tied, vocab_size=700, **TINY)
    model, info = Qwen3ForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert model.config.vocab_size == 700 and model.config.tie_word_embeddings == tied
    tok = AutoTokenizer.from_pretrained(d)
    gen = GenerationConfig.from_pretrained(d)
    assert tok.eos_token_id in gen.eos_token_id
    ids = torch.tensor([tok.encode("Tell me a story about the sea.")])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
        eos_token_id=None,
    )[0, ids.shape[1] :]  # fmt: skip
    assert len(set(out.tolist())) >= 4, f"greedy output barely varies: {out.tolist()}"


def test_same_seed_same_bytes_and_sharding(tmp_path: Path) -> None:
    def digest(d: Path) -> str:
        h = hashlib.sha256()
        for f in sorted(d.glob("*.safetensors")):
            h.update(f.read_bytes())
        return h.hexdigest()

    a = build_random_qwen3(tmp_path / "a", seed=3, **TINY)
    b = build_random_qwen3(tmp_path / "b", seed=3, **TINY)
    c = build_random_qwen3(tmp_path / "c", seed=4, **TINY)
    assert digest(a) == digest(b) != digest(c)
    sharded = build_random_qwen3(tmp_path / "s", seed=3, max_shard_bytes=50_000, **TINY)
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1


def test_presets_have_real_shapes() -> None:
    assert set(QWEN3_PRESETS) == {"0.6B", "1.7B", "4B", "8B", "14B", "32B"}
    for name, p in QWEN3_PRESETS.items():
        assert p["head_dim"] == 128 and p["vocab_size"] == 151936
        assert p["num_heads"] % p["num_kv_heads"] == 0
        assert p["tie_word_embeddings"] == (name in ("0.6B", "1.7B", "4B"))


def test_demo_checkpoint_is_built_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TP_ENGINE_CACHE", str(tmp_path))
    d = demo_checkpoint_dir()
    assert d.parent == tmp_path and (d / "config.json").exists()
    mtime = (d / "config.json").stat().st_mtime_ns
    assert demo_checkpoint_dir() == d
    assert (d / "config.json").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [d.name]  # no temporary directory left


def test_concurrent_first_use_of_the_demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    # Every rank of a torchrun job reaches the first use at once; all must end up with the same
    # complete directory. Threads race on the same file-system rename that processes would
    # (processes cannot be forked here: the tokenizer trainer's thread pool would deadlock).
    monkeypatch.setenv("TP_ENGINE_CACHE", str(tmp_path))
    start = threading.Barrier(3)
    results: list[Path] = []

    def first_use() -> None:
        start.wait()
        results.append(demo_checkpoint_dir())

    threads = [threading.Thread(target=first_use) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 3 and len(set(results)) == 1
    (d,) = tmp_path.iterdir()
    assert (d / "config.json").exists() and (d / "model.safetensors").exists()
