"""`LLM.generate` with pipeline parallelism end to end against transformers (float32, CPU, gloo).

TP 1 x PP 2 and TP 2 x PP 2 (2 and 4 real processes: rank = pp_rank * TP + tp_rank), on a dense
3-layer checkpoint with a tied head (so the last stage loads its own copy of the embedding, and
vLLM's split is the uneven (0, 2), (2, 3)) and on a Qwen3-MoE one (untied, every layer
sparse; its experts sliced over each stage's ranks, or whole per rank with expert parallelism),
plus an explicit uneven partition from `$TP_ENGINE_PP_LAYER_PARTITION` ("1,2"). Greedy
token ids must equal transformers' for every prompt: with prefix caching and chunked prefill
under a small token budget, with a KV pool small enough to force preemption, and with
asynchronous scheduling (the sampled tokens broadcast from rank 0). One process group per case
serves every scenario (`LLMEngine.reconfigure` changes rank 0's knobs only). A sleep, a wake
and a reload from disk change no token, at every case (TP 2 x PP 2 and MoE included).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.moe_cases import MIN_ROUTER_MARGIN, load_hf_moe, router_margins
from tests.moe_cases import hf_greedy as hf_greedy_of
from tests.tp_cases import MAX_MODEL_LEN
from tp_engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
DENSE = dict(hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
             intermediate_size=64, tie_word_embeddings=True, seed=31)  # fmt: skip
MOE = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, num_experts=6,
           num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
           tie_word_embeddings=False, seed=21)  # fmt: skip
# id -> (checkpoint, TP, PP, $TP_ENGINE_PP_LAYER_PARTITION, rank 0's layers)
CASES = {
    "dense-tp1pp2": ("dense", 1, 2, None, range(0, 2)),
    "dense-tp1pp2-split1,2": ("dense", 1, 2, "1,2", range(0, 1)),
    "dense-tp2pp2": ("dense", 2, 2, None, range(0, 2)),
    "moe-tp1pp2": ("moe", 1, 2, None, range(0, 1)),
    "moe-tp2pp2": ("moe", 2, 2, None, range(0, 1)),
    "moe-tp2pp2-ep": ("moe", 2, 2, None, range(0, 1)),
}


def make_prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    rand = lambda n: torch.randint(0, vocab_size, (n,), generator=g).tolist()  # noqa: E731
    shared = rand(12)
    # Prompts sharing a 12-token (3-block) prefix, one that is another's exact prefix.
    return [rand(n) for n in (1, 6, 17, 30)] + [shared + rand(5), shared]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, tuple[Path, list[list[int]], list[list[int]]]]:
    """Per checkpoint: its directory, the prompts and transformers' greedy continuations."""
    from transformers import Qwen3ForCausalLM

    from tp_engine.testing import build_random_qwen3, build_random_qwen3_moe

    root = tmp_path_factory.mktemp("pp")
    dense = build_random_qwen3(root / "dense", max_position_embeddings=MAX_MODEL_LEN, **DENSE)
    moe = build_random_qwen3_moe(root / "moe", max_position_embeddings=MAX_MODEL_LEN, **MOE)
    refs = {}
    for name, path, model in (
        ("dense", dense, Qwen3ForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()),
        ("moe", moe, load_hf_moe(moe)),
    ):
        prompts = make_prompts(model.config.vocab_size)
        expected = hf_greedy_of(model, prompts, MAX_TOKENS)
        if name == "moe":  # no token sits on a routing near-tie (tests/moe_cases.py)
            sequences = [p + e for p, e in zip(prompts, expected, strict=True)]
            assert router_margins(model, sequences) > MIN_ROUTER_MARGIN
        refs[name] = (path, prompts, expected)
    return refs


@pytest.fixture(scope="module", params=list(CASES))
def llm(request, references):
    ckpt, tp, pp, partition, _ = CASES[request.param]
    with pytest.MonkeyPatch.context() as m:
        if partition is not None:  # read once, on rank 0, while the engine starts
            m.setenv("TP_ENGINE_PP_LAYER_PARTITION", partition)
        else:
            m.delenv("TP_ENGINE_PP_LAYER_PARTITION", raising=False)
        engine = LLM(
            str(references[ckpt][0]),
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            block_size=4,
            num_kv_blocks=64,
            max_num_seqs=8,
            max_num_batched_tokens=MAX_MODEL_LEN,
            # Whole experts per rank inside each stage (the default slices every expert).
            enable_expert_parallel=request.param.endswith("-ep"),
        )
    engine.case = request.param
    yield engine
    engine.shutdown()


def check_matches_hf(llm, references, fresh: bool = True, **knobs) -> list:
    """Generate every prompt and compare with transformers; `fresh`: first reconfigure the
    launch knobs with `knobs` (a fresh block manager: an empty prefix cache)."""
    _, prompts, expected = references[CASES[llm.case][0]]
    if fresh:
        llm.engine.reconfigure(**knobs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs]
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"prompt {i} (len {len(prompts[i])}): engine {g} != transformers {e}"
    bm = llm.engine.core.scheduler.block_manager
    assert bm.usage == 0.0
    bm.check_integrity()
    return outputs


def test_rank0_holds_its_stage_only(llm) -> None:
    _, tp, pp, _, layers = CASES[llm.case]
    runner = llm.engine.runner
    assert llm.engine.tp.size == tp * pp
    assert (runner.pipe.stage.index, runner.pipe.tp.size) == (0, tp)
    assert runner.pipe.stage.layers == layers
    assert len(runner.kv_caches) == len(layers) == runner.kv_spec.num_layers
    held = {int(n.split(".")[2]) for n, _ in runner.model.named_parameters() if ".layers." in n}
    assert held == set(layers)
    assert runner.model.head is None and runner.model.model.norm is None


def test_prefix_caching_and_chunked_prefill(llm, references) -> None:
    knobs = dict(enable_prefix_caching=True, enable_chunked_prefill=True)
    check_matches_hf(llm, references, max_num_batched_tokens=8, max_num_seqs=4, **knobs)
    # The same prompts again, on the same block manager: they start from the prefix cache.
    outputs = check_matches_hf(llm, references, fresh=False)
    assert sum(o.num_cached_tokens for o in outputs) > 0


def test_small_kv_pool_forces_preemption(llm, references) -> None:
    # 14 blocks of 4 = 56 slots for 6 prompts of up to 30 + 6 tokens.
    check_matches_hf(llm, references, num_kv_blocks=14)
    assert llm.engine.core.scheduler.num_preemptions > 0


def test_async_scheduling(llm, references) -> None:
    check_matches_hf(llm, references, async_scheduling=True, max_num_batched_tokens=8)
    assert llm.engine.async_scheduling


def test_sleep_and_a_disk_update_keep_the_tokens(llm, references) -> None:
    """Sleep mode and weight updates at every case (tests/test_pp_rl.py is their own module,
    at TP 1 x PP 2): a level-1 sleep, a wake, and a reload of the same checkpoint."""
    llm.sleep(level=1)
    assert llm.is_sleeping()
    llm.wake_up()
    llm.update_weights_from_disk(str(references[CASES[llm.case][0]][0]))
    assert not llm.is_sleeping()
    check_matches_hf(llm, references)
