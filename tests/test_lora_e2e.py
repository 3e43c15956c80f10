"""Multi-LoRA through `LLM.generate`: a mixed batch of three PEFT adapters and the base model
equals transformers + PEFT (float32, greedy) request by request, and each request equals its
run alone, at TP 1, 2 and 4; the prefix cache never serves one adapter's K/V to another (nor
an unloaded adapter's to the adapter loaded under its name); `max_loras` bounds every step's
adapters while all of them finish correctly; an adapter evicted from the ranks' host memory
reloads with the same outputs; refusals carry vLLM's messages and the engine serves on.

The adapters (`tests.lora_cases`) differ in rank, modules and scaling; their B is non-zero.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch

from tests.lora_cases import (
    ALL_MODULES,
    BASE_CHECKPOINT,
    MAX_LORA_RANK,
    REFUSALS,
    build_adapter,
    build_adapters,
    build_bad_adapters,
    load_base,
)
from tests.moe_cases import hf_greedy
from tests.tp_cases import MAX_MODEL_LEN
from tp_engine import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 5
# Prompt lengths of the mixed batch: (adapter, length), base and every adapter twice at TP 1
# and 2, once at TP 4.
MIXED = [(None, 9), ("a", 6), ("b", 13), ("c", 5), ("c", 17), (None, 3), ("a", 11), ("b", 7)]


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from peft import PeftModel

    from tp_engine.testing import build_random_qwen3

    root = tmp_path_factory.mktemp("lora_e2e")
    base = build_random_qwen3(
        root / "base", max_position_embeddings=MAX_MODEL_LEN, **BASE_CHECKPOINT
    )
    adapters = build_adapters(base, root)
    adapters["d"] = build_adapter(
        base, root / "d", 14, r=8, lora_alpha=8, target_modules=ALL_MODULES
    )
    vocab = load_base(base).config.vocab_size
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for _, n in MIXED]
    long_prompt = torch.randint(0, vocab, (17,), generator=g).tolist()  # 4 full blocks of 4
    reference: dict[str | None, list[list[int]]] = {}
    for name in (None, *adapters):
        model = load_base(base)
        if name is not None:
            model = PeftModel.from_pretrained(model, adapters[name]).eval()
        reference[name] = hf_greedy(model, [*prompts, long_prompt], MAX_TOKENS)
    for name in adapters:  # an adapter that changes nothing would test nothing
        assert reference[name] != reference[None], name
    return {
        "base": base,
        "adapters": {name: str(path) for name, path in adapters.items()},
        "bad": {
            name: str(p) for name, p in build_bad_adapters(adapters["a"], root / "bad").items()
        },
        "prompts": prompts,
        "long_prompt": long_prompt,
        "reference": reference,
    }


def lora(case: dict[str, Any], name: str | None, int_id: int | None = None) -> LoRARequest | None:
    if name is None:
        return None
    return LoRARequest(name, int_id or "abcd".index(name) + 1, case["adapters"][name])


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def generate(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None]) -> list[Any]:
    return llm.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False, lora_request=loras
    )


def start_llm(case: dict[str, Any], tp: int, **kwargs: Any) -> LLM:
    return LLM(
        str(case["base"]), tensor_parallel_size=tp, block_size=4, num_kv_blocks=96,
        max_num_seqs=8, max_num_batched_tokens=MAX_MODEL_LEN, enable_lora=True,
        max_lora_rank=MAX_LORA_RANK, **kwargs,
    )  # fmt: skip


# TP 1 last: the tests without this fixture start their own TP 1 engine beside it (one
# process holds one process group of more than one rank at a time).
@pytest.fixture(scope="module", params=[4, 2, 1], ids=lambda tp: f"tp{tp}")
def llm(request, case):
    engine = start_llm(case, request.param, max_loras=3, max_cpu_loras=4)
    engine.tp_size = request.param
    yield engine
    engine.shutdown()


def test_mixed_batch_equals_peft_and_each_run_alone(llm, case):
    work = list(enumerate(MIXED))[: 4 if llm.tp_size == 4 else None]
    prompts = [case["prompts"][i] for i, _ in work]
    loras = [lora(case, name) for _, (name, _) in work]
    expected = [case["reference"][name][i] for i, (name, _) in work]
    mixed = [o.outputs[0].token_ids for o in generate(llm, prompts, loras)]
    assert mixed == expected
    alone = work if llm.tp_size == 1 else work[:2]
    for (i, (name, _)), want in zip(alone, expected, strict=False):
        [out] = generate(llm, [case["prompts"][i]], [lora(case, name)])
        assert out.outputs[0].token_ids == want, (i, name)


def test_prefix_cache_is_per_adapter_and_per_load(llm, case):
    if llm.tp_size != 1:
        pytest.skip("rank 0's bookkeeping: TP 1 shows it")
    prompt, ref = case["long_prompt"], case["reference"]

    def run(name: str | None, request: LoRARequest | None = None) -> tuple[list[int], int]:
        [out] = generate(llm, [prompt], [request or lora(case, name)])
        return out.outputs[0].token_ids, out.num_cached_tokens

    llm.reset_prefix_cache()
    first = [run(name) for name in (None, "a", "b")]
    assert [c for _, c in first] == [0, 0, 0]  # no hit across adapters
    again = [run(name) for name in (None, "a", "b")]
    assert [c for _, c in again] == [16, 16, 16]  # full hits within one
    assert [t for t, _ in first + again] == [ref[n][-1] for n in (None, "a", "b")] * 2
    # Unload a, load c's weights under the name "a": no stale hit, c's outputs.
    assert llm.engine.remove_lora(1) and 1 not in llm.engine.list_loras()
    renamed = LoRARequest("a", 9, case["adapters"]["c"])
    assert llm.engine.add_lora(renamed)
    assert run("a", renamed) == (ref["c"][-1], 0)
    # Refusals with vLLM's messages; the engine serves on.
    for name, message in REFUSALS.items():
        bad = LoRARequest(f"bad-{name}", 100 + len(name), case["bad"][name])
        with pytest.raises(ValueError) as err:
            generate(llm, [prompt], [bad])
        assert err.value.args[0].endswith(message.format(path=case["bad"][name])), name
    assert run(None) == (ref[None][-1], 16)
    # chat passes its adapter on: the conversation's first token under c differs from base.
    hi = [{"role": "user", "content": "Hi"}]
    chat = [llm.chat(hi, greedy(), use_tqdm=False, lora_request=lora(case, n)) for n in (None, "c")]
    assert chat[0][0].outputs[0].token_ids != chat[1][0].outputs[0].token_ids


def test_max_loras_bounds_each_step_and_host_lru_reloads(case):
    # Asynchronous scheduling (a GPU's default): loads between steps quiesce the step in flight.
    llm = start_llm(case, 1, max_loras=2, max_cpu_loras=2, async_scheduling=True)
    try:
        executor = llm.engine.executor.step_executor  # rank 0's StepExecutor
        run_plan = executor.run
        per_step: list[set[int]] = []

        def recording(plan, *args):
            slots = plan.section("adapter_slots")
            per_step.append(set(slots[slots >= 0].tolist()))
            return run_plan(plan, *args)

        executor.run = recording
        names = ["a", "b", None, "c", "d", "a", "d", "b"]
        prompts = case["prompts"]
        outs = generate(llm, prompts, [lora(case, n) for n in names])
        ref = case["reference"]
        assert [o.outputs[0].token_ids for o in outs] == [ref[n][i] for i, n in enumerate(names)]
        assert max(len(s) for s in per_step) == 2  # never more than the slots, and both used
        host = llm.engine.runner.lora.host  # the ranks' host LRU of max_cpu_loras adapters
        assert len(host) == 2
        a_uid = llm.engine.lora.by_id[1].load_id
        assert a_uid not in host  # evicted: reloaded from disk below
        [out] = generate(llm, [prompts[0]], [lora(case, "a")])
        assert out.outputs[0].token_ids == ref["a"][0]
    finally:
        llm.shutdown()


def test_adapter_the_ranks_refuse_ends_all_its_samples(case, tmp_path):
    """An adapter rank 0's config check passes but the ranks refuse (a tensor of the wrong
    shape): every sample of its n > 1 request ends aborted, the held sibling too, and the
    engine serves the other adapter's request beside it."""
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(case["adapters"]["a"], bad)
    weights = load_file(bad / "adapter_model.safetensors")
    key = next(k for k in weights if ".lora_A." in k)
    weights[key] = torch.zeros(weights[key].shape[0], 8)
    save_file(weights, bad / "adapter_model.safetensors")
    llm = start_llm(case, 1, max_loras=1, async_scheduling=False)
    try:
        engine = llm.engine
        params = SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS)
        engine.add_request(
            "r", case["prompts"][0], params, lora_request=LoRARequest("x", 9, str(bad))
        )
        engine.add_request("g", case["prompts"][1], greedy(), lora_request=lora(case, "a"))
        tokens: dict[str, list[int]] = {}
        reasons: dict[str, str] = {}
        while engine.has_unfinished():
            engine.stats()  # names the adapters of the waiting requests
            for out in engine.step().outputs:
                tokens.setdefault(out.seq_id, []).extend(out.new_token_ids)
                if out.finished:
                    reasons[out.seq_id] = out.finish_reason
        assert reasons == {"0_r": "abort", "1_r": "abort", "g": "length"}
        assert tokens["g"] == case["reference"]["a"][1]
        assert engine.list_loras() == {1} and engine.stats().waiting_lora_adapters == []
    finally:
        llm.shutdown()


def test_lora_request_without_enable_lora_is_refused(case):
    llm = LLM(str(case["base"]), block_size=4, num_kv_blocks=16)
    try:
        with pytest.raises(ValueError, match="but LoRA is not enabled!"):
            generate(llm, [case["prompts"][0]], [lora(case, "a")])
    finally:
        llm.shutdown()
