"""`launch/demo_assets.py`: the demo embedder, reranker and adapters it writes are what they claim
to be, judged by the references (sentence-transformers, the reranker card's formula with
transformers, PEFT's forward), so the README's "Try it" walkthroughs show correct numbers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.pooling_cases import RERANKER_OVERRIDES, reranker_reference
from tests.server_harness import REPO_ROOT

pytestmark = pytest.mark.slow

TEXTS = ["What is the capital of China?", "Explain gravity", "a"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "demo-assets"
    cmd = [sys.executable, "launch/demo_assets.py", "--out", str(out)]
    for verb in ("written", "kept"):  # a second run keeps what is there
        run = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        assert run.stdout.count(verb) == 5, run.stdout
    return out


def test_demo_embedder_equals_sentence_transformers(assets):
    from sentence_transformers import SentenceTransformer

    from tp_engine import LLM

    path = assets / "Qwen3-Embedding-demo"
    want = SentenceTransformer(str(path), device="cpu").encode(TEXTS, convert_to_tensor=True)
    llm = LLM(str(path), num_kv_blocks=64)
    try:
        assert llm.engine.model_spec.task == "embed"
        got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    finally:
        llm.shutdown()
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.99999


def test_demo_reranker_equals_the_card(assets):
    from tp_engine import LLM

    path = assets / "Qwen3-Reranker-demo"
    want = reranker_reference(path, [(TEXTS[0], d) for d in TEXTS])
    llm = LLM(str(path), hf_overrides=RERANKER_OVERRIDES, num_kv_blocks=64)
    try:
        got = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert got == pytest.approx(want, abs=1e-5)
    assert max(want) - min(want) > 1e-4  # the scores tell the documents apart


def test_demo_adapters_equal_peft(assets):
    from tests.lora_cases import peft_logits
    from tp_engine import LLM, LoRARequest, SamplingParams
    from tp_engine.demo import demo_checkpoint_dir

    base = demo_checkpoint_dir()
    names = ["sql", "chat", "math"]
    requests = [LoRARequest(n, i, str(assets / "adapters" / n)) for i, n in enumerate(names, 1)]
    prompt = [5, 17, 42, 7, 99]
    llm = LLM(None, enable_lora=True, max_loras=3, num_kv_blocks=64)
    try:
        params = SamplingParams(temperature=0, max_tokens=1, logprobs=0)
        outs = llm.generate([prompt] * 4, params, lora_request=[*requests, None], use_tqdm=False)
    finally:
        llm.shutdown()
    firsts = [o.outputs[0].token_ids[0] for o in outs]
    for adapter, first in zip([*names, None], firsts, strict=True):
        path = None if adapter is None else assets / "adapters" / adapter
        assert first == int(peft_logits(base, path, prompt)[-1].argmax()), adapter
    assert len(set(firsts)) > 1  # the adapters change the output
