"""Pipeline-parallel engines of their own, one after another: n-gram speculative decoding (which
works as it is: the drafts are rank 0's and the verify rows are logits rows), and a rank that
fails mid-step on either stage (`generate` raises naming it, within seconds: the receives of a
hand-off or of the logits fail with their peer, nothing waits for the group's timeout).

Its own module, so that no other test's process group is alive in this process when these start
theirs (`tests/test_pp_e2e.py` keeps one per case for its whole module).
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.moe_cases import hf_greedy
from tests.tp_cases import MAX_MODEL_LEN
from tp_engine import LLM, SamplingParams
from tp_engine.engine import EngineDeadError

pytestmark = pytest.mark.slow

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    from tp_engine.testing import build_random_qwen3

    return build_random_qwen3(
        tmp_path_factory.mktemp("pp") / "dense", hidden_size=32, num_layers=3, num_heads=4,
        num_kv_heads=2, head_dim=8, intermediate_size=64, tie_word_embeddings=True,
        max_position_embeddings=MAX_MODEL_LEN, seed=31,
    )  # fmt: skip


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_ngram_speculative_decoding(dense) -> None:
    """n-gram drafts verified under TP 1 x PP 2 keep transformers' greedy outputs."""
    from transformers import Qwen3ForCausalLM

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 600, (n,), generator=g).tolist() for n in (3, 9, 20)]
    model = Qwen3ForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    expected = hf_greedy(model, prompts, MAX_TOKENS)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    llm = LLM(str(dense), pipeline_parallel_size=2, speculative_config=spec, block_size=4,
              num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=MAX_MODEL_LEN)  # fmt: skip
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert llm.engine.spec_stats.num_accepted_tokens > 0  # drafts were verified and kept
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("tp", "rank", "kind"),
    [(1, 1, "exit"), (1, 1, "raise"), (2, 3, "exit"), (2, 1, "raise")],
    ids=["tp1pp2-last-stage-exits", "tp1pp2-last-stage-raises", "tp2pp2-output-rank-exits",
         "tp2pp2-stage0-rank1-raises"],
)  # fmt: skip
def test_a_failing_stage_rank_fails_generate_naming_it(dense, monkeypatch, tp, rank, kind):
    monkeypatch.setenv("TP_ENGINE_FAULT", f"rank={rank},step=2,kind={kind}")
    llm = LLM(str(dense), tensor_parallel_size=tp, pipeline_parallel_size=2, block_size=4,
              num_kv_blocks=64)  # fmt: skip
    workers = list(llm._ranks.group.procs)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=rf"rank {rank}") as info:
        llm.generate([[1, 2, 3, 4, 5]] * 3, greedy(8), use_tqdm=False)
    assert time.monotonic() - start < 60, "the failure took the group's timeout to surface"
    assert info.value.rank == rank
    if kind == "raise":
        assert f"injected fault on rank {rank} at step 2" in str(info.value)
    assert all(p.poll() is not None for p in workers), "a worker outlived the failed engine"
