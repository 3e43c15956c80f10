"""Greedy tokens of the whole engine with each attention candidate forced on, against Hugging Face
transformers (fp32, TP = 1; interpreted on CPU, native on a GPU).

The candidates are forced as a lease or a user would force them ($TP_ENGINE_DECODE_KERNEL=packed,
$TP_ENGINE_PREFILL_KERNEL=tma, `kernels.attention_tables`), and a spy on the candidate's entry
point proves it ran. The workload is test_llm_e2e's: prompts of 1 to 45 tokens, three sharing a
prefix, chunked by a 32-token budget next to running decodes, so the steps mix decodes, fresh
prompts (the TMA kernel's case) and later chunks (which stay on the paged kernel).
"""

from __future__ import annotations

import pytest

from kernels import attention_tables as at
from tests.test_llm_e2e import MAX_TOKENS, check_matches_hf, make_prompts
from tests.tp_cases import build_checkpoints, hf_greedy

pytestmark = pytest.mark.slow

CKPT = "tied_kv2_oddvocab"  # head_dim 16, 4 query heads over 2 KV heads: one packed program


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(build_checkpoints(tmp_path_factory.mktemp("ckpt"))[CKPT])


@pytest.fixture(scope="module")
def references(checkpoint) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    from transformers import AutoConfig

    prompts = make_prompts(AutoConfig.from_pretrained(checkpoint).vocab_size)
    return {CKPT: (prompts, hf_greedy(checkpoint, prompts, MAX_TOKENS))}


def test_forced_candidates_match_hf(checkpoint, references, monkeypatch):
    """Both candidates forced in one engine (one engine's start-up and interpreted run, not two):
    decodes take the packed kernel, fresh prompts the TMA kernel."""
    _forced_candidates_match_hf(checkpoint, references, monkeypatch)


@pytest.mark.gpu
def test_forced_candidates_match_hf_gpu(checkpoint, references, monkeypatch):
    """The same natively, for the lease's `-m gpu` pass (fp32: the kernels' exact path)."""
    _forced_candidates_match_hf(checkpoint, references, monkeypatch)


def _forced_candidates_match_hf(checkpoint, references, monkeypatch) -> None:
    import kernels.decode_attention_packed as packed
    from rank_worker.attention import triton_backend
    from tp_engine import LLM

    monkeypatch.delenv(at.TABLES_ENV, raising=False)
    monkeypatch.setenv(at.DECODE_KERNEL_ENV, "packed")
    monkeypatch.setenv(at.PREFILL_KERNEL_ENV, "tma")
    at.reset()
    calls: dict[str, int] = {"packed": 0, "tma": 0}
    for name, target, entry in (
        ("packed", packed, "launch_meta"),
        ("tma", triton_backend, "fresh_prefill_attention"),
    ):
        real = getattr(target, entry)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(target, entry, spy)
    try:
        with LLM(
            checkpoint, attention_backend="triton", block_size=4, num_kv_blocks=128,
            max_num_seqs=8, max_num_batched_tokens=32,
        ) as llm:  # fmt: skip
            llm.ckpt_name = CKPT
            check_matches_hf(llm, references)
    finally:
        at.reset()
    assert calls["packed"] and calls["tma"], calls
