"""Speculative decoding with an EAGLE-3 head.

A tiny target (`build_predictable_target`: a random 4-layer Qwen3 from the test kit with its
layers' output projections scaled down, so that its greedy text is learnable) and a head
trained on the target's own greedy continuations (`train_eagle3_head`, SpecForge's TTT
recipe at toy scale, seeded; once per cache directory, `cached_eagle3_pair`). Checked: the head's inputs are transformers'
`output_hidden_states` at the named layers (pinned and default); greedy outputs equal
transformers at TP 1, 2 (prefix caching + chunked prefill, a small budget, preemption) and 4
(one short case); seeded sampling equals the run without speculation; both published layouts
of the same weights draft the same; the acceptance equals a plain-torch reference of EAGLE-3
drafting (below, written out with no cache) within a stated margin; vLLM's counters; the
refusals at start.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.moe_cases import hf_greedy
from tp_engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

K = 3
MAX_TOKENS = 20
VOCAB = 643  # the test tokenizer's, the target's vocabulary
# Mean accepted length (tokens per verify step) of the engine vs the reference: the same
# drafts up to float summation order, so they agree to well within 3%.
ACCEPT_MARGIN = 0.03


def _prompts(n: int, lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (lengths[i % len(lengths)],), generator=g).tolist()
            for i in range(n)]  # fmt: skip


def relayout(head: Path, out: Path, layout: str, layer_ids: list[int] | None) -> Path:
    """The same weights written in another layout (or with other pinned ids)."""
    from tp_engine.testing.eagle3_heads import write_eagle3_head

    cfg = json.loads((head / "config.json").read_text())
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size",
            "draft_vocab_size")  # fmt: skip
    tensors = load_file(str(head / "model.safetensors"))
    return write_eagle3_head(
        out, tensors, {k: cfg[k] for k in keys}, layout=layout, layer_ids=layer_ids
    )


@pytest.fixture(scope="session")
def eagle(tmp_path_factory) -> dict[str, Path]:
    from tp_engine.testing.eagle3_heads import cached_eagle3_pair

    root = tmp_path_factory.mktemp("eagle3")
    # Pinned (SpecForge's reading, layer outputs): 0, 1, 2 = transformers' hidden_states 1..3.
    # Trained once per cache directory (`cached_eagle3_pair`: 32 prompts, 150 Adam steps).
    target, head = cached_eagle3_pair()
    return {
        "target": target,
        "head": head,
        # vLLM speculators' layout: ids are layer inputs, so the same states are 1, 2, 3.
        "speculators": relayout(head, root / "speculators", "speculators", [1, 2, 3]),
        # No pinned ids: the published default, inputs of layers (2, L/2, L-3) = (2, 2, 1).
        "default": relayout(head, root / "default", "specforge", None),
    }


@pytest.fixture(scope="session")
def reference(eagle):
    prompts = _prompts(6, (1, 5, 8, 13, 21, 30), seed=1)
    model = _hf(eagle["target"])
    return prompts, hf_greedy(model, prompts, MAX_TOKENS)


def _hf(target: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()


def _llm(target: Path, tp: int, head: Path | None, **kw) -> LLM:
    spec = None if head is None else {
        "method": "eagle3", "model": str(head), "num_speculative_tokens": K}  # fmt: skip
    args = dict(block_size=4, num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=128)
    return LLM(str(target), tensor_parallel_size=tp, speculative_config=spec, **{**args, **kw})


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _generate(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# -- the head's inputs ------------------------------------------------------------------------


@pytest.mark.parametrize(("which", "hf_layers"), [("head", (1, 2, 3)), ("default", (2, 2, 1))])
def test_hidden_states_equal_transformers(eagle, which, hf_layers):
    """The states a RUN plan's `hidden_rows` asks for are transformers' hidden_states at the
    head's layers (index 0 is the embedding output, i the input of layer i)."""
    from rank_worker.runner.model_runner import ModelRunner, synthetic_plan
    from rank_worker.runner_config import RunnerConfig
    from rank_worker.tp import TPInfo

    config = RunnerConfig(max_model_len=64, block_size=4, max_num_seqs=4,
                          max_num_batched_tokens=32, num_kv_blocks=8,
                          eagle3_head=str(eagle[which]))  # fmt: skip
    runner = ModelRunner(eagle["target"], config, TPInfo(0, 1), "cpu")
    runner.init_kv_cache(8)
    assert runner.model.model.capture_layers == hf_layers
    prompt = _prompts(1, (11,), seed=7)[0]
    rows = torch.tensor([10, 0, 4, 7])
    plan = synthetic_plan([(0, 11, [0, 1, 2])]).with_sections(
        hidden_rows=rows.numpy().astype("int32")
    )
    plan = dataclasses.replace(plan, input_ids=torch.tensor(prompt).int().numpy())
    runner.execute(plan)
    got = runner.eagle3.take_hidden_states()  # [4, 3H]
    assert runner.eagle3.take_hidden_states() is None  # handed over once
    with torch.no_grad():
        hs = _hf(eagle["target"])(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    want = torch.cat([hs[i][0, rows] for i in hf_layers], dim=-1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    runner.release()


def test_hidden_states_reach_rank_0_at_tp2(eagle):
    """Through the executor at TP 2: the `hidden_rows` section crosses the ring, and
    `StepResult.hidden_states` holds the states (computed on sharded layers) transformers has."""
    from rank_worker.runner.model_runner import synthetic_plan

    prompt = _prompts(1, (9,), seed=8)[0]
    rows = [8, 2, 5]
    with _llm(eagle["target"], 2, eagle["head"], enable_prefix_caching=False) as llm:
        core = llm.engine
        plan = dataclasses.replace(
            synthetic_plan([(0, 9, [0, 1, 2])]),
            step_id=core.take_step_id(),
            input_ids=torch.tensor(prompt).int().numpy(),
        ).with_sections(hidden_rows=torch.tensor(rows).int().numpy())
        got = core.executor.execute(plan, None, None).hidden_states
    with torch.no_grad():
        hs = _hf(eagle["target"])(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    want = torch.cat([hs[i][0, rows] for i in (1, 2, 3)], dim=-1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# -- outputs ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eagle_llm(request, eagle):
    llm = _llm(eagle["target"], request.param, eagle["head"])
    llm.tp = request.param
    yield llm
    llm.shutdown()


KNOBS = {
    "prefix_chunked": {"enable_prefix_caching": True, "enable_chunked_prefill": True},
    "small_budget": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
    "small_pool": {"num_kv_blocks": 16},
}
# TP 1 and 2 with every knob; TP 4 one short case (two prompts).
CASES = [(tp, name) for tp in (1, 2) for name in KNOBS] + [(4, "prefix_chunked")]


@pytest.mark.parametrize(
    ("eagle_llm", "knobs"), CASES, indirect=["eagle_llm"], ids=[f"tp{t}-{k}" for t, k in CASES]
)
def test_greedy_equals_transformers(eagle_llm, reference, knobs):
    prompts, expected = reference
    if eagle_llm.tp == 4:
        prompts, expected = prompts[:2], expected[:2]
    eagle_llm.engine.reconfigure(**KNOBS[knobs])
    before = eagle_llm.engine.spec_stats.num_accepted_tokens
    assert _generate(eagle_llm, prompts) == expected
    stats = eagle_llm.engine.spec_stats
    assert stats.num_accepted_tokens > before, "no draft was accepted"
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    if knobs == "small_pool":
        assert eagle_llm.engine.core.scheduler.num_preemptions > 0
    bm = eagle_llm.engine.core.scheduler.block_manager
    assert bm.usage == 0.0
    bm.check_integrity()


def test_seeded_sampling_is_the_run_without_speculation(eagle, reference):
    prompts, _ = reference
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=MAX_TOKENS,
                             ignore_eos=True) for i in range(len(prompts))]  # fmt: skip
    with _llm(eagle["target"], 1, None) as llm:
        plain = _generate(llm, prompts, params)
    with _llm(eagle["target"], 1, eagle["head"]) as llm:
        assert _generate(llm, prompts, params) == plain
        assert llm.engine.spec_stats.num_drafts > 0


# -- acceptance against a plain-torch reference ---------------------------------------------------
# EAGLE-3 drafting written out with no cache: every draft recomputes the head over all of the
# sequence's entries (entry p: the token after p beside fc(the target's states at p), from a
# full transformers forward), then chains k entries on its own outputs.


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    a = pos[:, None].float() * inv
    cos, sin = a.cos()[:, None], a.sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _load_head(head: Path):
    cfg = json.loads((head / "config.json").read_text())
    w = load_file(str(head / "model.safetensors"))
    layers = [i + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    return cfg, w, layers


def _head_layer(cfg, w, e, h, pos):
    """y of entries `[S]` (causal over all of them)."""
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    m = "midlayer."
    z = torch.cat([_rms(e, w[m + "input_layernorm.weight"], eps),
                   _rms(h, w[m + "hidden_norm.weight"], eps)], -1)  # fmt: skip
    s = z.shape[0]
    q = _rope((z @ w[m + "self_attn.q_proj.weight"].T).view(s, nh, hd), pos, theta)
    k = _rope((z @ w[m + "self_attn.k_proj.weight"].T).view(s, nkv, hd), pos, theta)
    v = (z @ w[m + "self_attn.v_proj.weight"].T).view(s, nkv, hd)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * hd**-0.5
    scores = scores.masked_fill(torch.ones(s, s).triu(1).bool(), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(s, -1)
    y = h + o @ w[m + "self_attn.o_proj.weight"].T
    n = _rms(y, w[m + "post_attention_layernorm.weight"], eps)
    mlp = torch.nn.functional.silu(n @ w[m + "mlp.gate_proj.weight"].T)
    return y + (mlp * (n @ w[m + "mlp.up_proj.weight"].T)) @ w[m + "mlp.down_proj.weight"].T


def reference_drafts(model, head, seq: list[int], k: int) -> list[int]:
    """k greedy drafts after `seq`, whose last token the target has not seen yet."""
    cfg, w, layers = head
    ids = torch.tensor([seq])
    emb = model.get_input_embeddings()
    hs = model(ids[:, :-1], output_hidden_states=True).hidden_states
    aux = torch.cat([hs[i][0] for i in layers], -1)  # [L, 3H] states at positions 0..L-1
    e, h = emb(ids[0, 1:]), aux @ w["fc.weight"].T  # entry p: token p + 1, states at p
    drafts: list[int] = []
    for _ in range(k):
        y = _head_layer(cfg, w, e, h, torch.arange(e.shape[0]))[-1]
        d = int((_rms(y, w["norm.weight"], cfg["rms_norm_eps"]) @ w["lm_head.weight"].T).argmax())
        drafts.append(d + int(w["d2t"][d]))
        e = torch.cat([e, emb(torch.tensor(drafts[-1:]))])
        h = torch.cat([h, y[None]])
    return drafts


def reference_acceptance(model, head, prompts, expected) -> tuple[int, list[int]]:
    """Greedy verification of the reference's drafts as the engine schedules them (each
    decode offered min(k, tokens left - 1) drafts): (verify steps, accepted per position)."""
    steps, per_pos = 0, [0] * K
    with torch.no_grad():
        for prompt, out in zip(prompts, expected, strict=True):
            n = 1  # the prompt's step emits the first token
            while n < MAX_TOKENS:
                want = min(K, MAX_TOKENS - n - 1)
                if want <= 0:
                    n += 1
                    continue
                drafts = reference_drafts(model, head, prompt + out[:n], want)
                a = 0
                while a < want and drafts[a] == out[n + a]:
                    per_pos[a] += 1
                    a += 1
                steps += 1
                n += a + 1
    return steps, per_pos


def test_acceptance_matches_the_plain_torch_reference(eagle, reference):
    prompts, expected = reference
    steps, per_pos = reference_acceptance(
        _hf(eagle["target"]), _load_head(eagle["head"]), prompts, expected
    )
    ref_len = 1 + sum(per_pos) / steps
    with _llm(eagle["target"], 1, eagle["head"], enable_prefix_caching=False) as llm:
        assert _generate(llm, prompts) == expected
        stats = llm.engine.spec_stats
    got_len = 1 + stats.num_accepted_tokens / stats.num_drafts
    assert sum(per_pos) > 0, "the trained head drafts nothing the target accepts"
    assert abs(got_len - ref_len) <= ACCEPT_MARGIN * ref_len, (got_len, ref_len, per_pos)


def test_both_layouts_draft_the_same(eagle, reference):
    """The speculators copy of the same weights (layers.0.*, ids read as layer inputs) drafts
    exactly what the SpecForge one does."""
    prompts, expected = reference
    counts = []
    for which in ("head", "speculators"):
        with _llm(eagle["target"], 1, eagle[which]) as llm:
            assert _generate(llm, prompts[:3]) == expected[:3]
            s = llm.engine.spec_stats
            counts.append((s.num_drafts, s.num_draft_tokens, list(s.accepted_per_pos)))
    assert counts[0] == counts[1] and counts[0][2][0] > 0


def test_counters_have_vllms_names(eagle, reference):
    prompts, _ = reference
    with _llm(eagle["target"], 1, eagle["head"]) as llm:
        _generate(llm, prompts[:4])
        metrics = {m.name: m for m in llm.get_metrics()}
        stats = llm.engine.spec_stats
    assert metrics["vllm:spec_decode_num_drafts"].value == stats.num_drafts > 0
    assert metrics["vllm:spec_decode_num_draft_tokens"].value == stats.num_draft_tokens
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    assert 0 < accepted == stats.num_accepted_tokens
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    assert len(per_pos) == K and sum(per_pos) == accepted
    assert per_pos == sorted(per_pos, reverse=True)


# -- refusals -------------------------------------------------------------------------------------


def _broken(eagle, tmp_path: Path, edit_tensors=None, edit_config=None) -> Path:
    out = tmp_path / "broken"
    shutil.copytree(eagle["head"], out)
    if edit_tensors is not None:
        tensors = load_file(str(out / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(out / "model.safetensors"))
    if edit_config is not None:
        cfg = json.loads((out / "config.json").read_text())
        edit_config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def _set(d, key, value):
    d[key] = value


@pytest.mark.parametrize(
    ("tensors", "config", "match"),
    [
        (lambda t: _set(t, "fc.weight", torch.zeros(64, 128)), None,
         r"'fc\.weight' has shape \[64, 128\], expected \[64, 192\] \(fc reads the three"),
        (lambda t: _set(t, "d2t", torch.zeros(100, dtype=torch.long)), None,
         r"'d2t' has shape \[100\], expected \[160\]"),
        (lambda t: _set(t, "lm_head.weight", torch.zeros(200, 64)), None,
         r"'lm_head\.weight' has shape \[200, 64\], expected \[160, 64\]"),
        (lambda t: _set(t, "d2t", torch.full((160,), 600, dtype=torch.long)), None,
         r"'d2t' maps draft id 43 to 643, outside the target's vocabulary of 643"),
        (lambda t: _set(t, "midlayer.self_attn.q_norm.weight", torch.ones(16)), None,
         r"'midlayer\.self_attn\.q_norm\.weight' has no place in the head"),
        (lambda t: t.pop("norm.weight"), None, r"tensors \['norm\.weight'\] are missing"),
        (None, lambda c: _set(c["eagle_config"], "eagle_aux_hidden_state_layer_ids", [0, 1, 4]),
         r"eagle_aux_hidden_state_layer_ids \[0, 1, 4\] name layers \[4\] beyond the target's 4"),
        (None, lambda c: _set(c, "hidden_size", 32), r"hidden_size 32 differs from the target's 64"),
        (None, lambda c: _set(c, "draft_vocab_size", 700), r"draft_vocab_size 700 must be in"),
        (None, lambda c: _set(c, "architectures", ["LlamaForCausalLM"]),
         r"name neither LlamaForCausalLMEagle3"),
        (None, lambda c: _set(c, "fc_norm", True), r"'fc_norm' .* is not supported"),
    ],
    ids=["fc_width", "d2t_length", "lm_head_rows", "d2t_range", "unknown_tensor",
         "missing_tensor", "aux_layers", "hidden_size", "draft_vocab", "architecture", "fc_norm"],
)  # fmt: skip
def test_a_head_that_does_not_fit_is_refused_by_name(eagle, tmp_path, tensors, config, match):
    from rank_worker.models.model_spec import load_hf_config
    from rank_worker.spec.eagle3_format import read_eagle3_config

    broken = _broken(eagle, tmp_path, tensors, config)
    with pytest.raises(ValueError, match=match):
        read_eagle3_config(broken, load_hf_config(eagle["target"]))


def test_refusals_happen_at_start(eagle, tmp_path):
    broken = _broken(eagle, tmp_path, lambda t: _set(t, "fc.weight", torch.zeros(64, 128)))
    with pytest.raises(ValueError, match=r"fc\.weight"):
        _llm(eagle["target"], 1, broken)
    with pytest.raises(ValueError, match="speculative decoding cannot run with a pooling model"):
        _llm(eagle["target"], 1, eagle["head"], runner="pooling")


def test_speculators_ids_are_layer_inputs(eagle):
    """The same ids mean other layers in the two layouts (SGLang adds one, vLLM does not)."""
    from rank_worker.models.model_spec import load_hf_config
    from rank_worker.spec.eagle3_format import default_capture_layers, read_eagle3_config

    target = load_hf_config(eagle["target"])
    assert read_eagle3_config(eagle["head"], target).capture_layers == (1, 2, 3)
    assert read_eagle3_config(eagle["speculators"], target).capture_layers == (1, 2, 3)
    assert read_eagle3_config(eagle["default"], target).capture_layers == (2, 2, 1)
    assert default_capture_layers(36) == (2, 18, 33)  # Qwen3-8B: SpecForge's 1, 17, 32 + 1


def test_sglang_flags_spell_the_same_config(tmp_path):
    from tp_engine.config.speculative import SpeculativeConfig
    from tp_engine.server.args import build_parser, engine_config
    from tp_engine.testing import build_tokenizer

    build_tokenizer(tmp_path).save_pretrained(tmp_path)
    sglang = ["--tokenizer", str(tmp_path), "--speculative-algorithm", "EAGLE3",
              "--speculative-draft-model-path", "/heads/h", "--speculative-num-steps", "5"]  # fmt: skip
    vllm = ["--tokenizer", str(tmp_path), "--speculative-config",
            '{"method": "eagle3", "model": "/heads/h", "num_speculative_tokens": 5}']  # fmt: skip
    a = engine_config(build_parser().parse_args(sglang), 1).speculative_config
    b = engine_config(build_parser().parse_args(vllm), 1).speculative_config
    assert a == b == SpeculativeConfig("eagle3", 5, model="/heads/h")
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        engine_config(build_parser().parse_args(sglang[:4]), 1)
    with pytest.raises(ValueError, match="not both"):
        engine_config(build_parser().parse_args(sglang + vllm[2:]), 1)
    with pytest.raises(ValueError, match="NGRAM' is not supported"):
        engine_config(build_parser().parse_args(["--speculative-algorithm", "NGRAM"]), 1)


def test_sleep_gives_back_the_head_and_keeps_it(eagle, reference):
    """Sleep releases the head's weights and cache with the target's; the head's weights come
    back bit for bit at either level (no weight update writes them: kept on the host), so after
    sleep(2) and a reload of the target's weights the drafts are the same as before."""
    from safetensors.torch import load_file as load

    prompts, expected = reference
    with _llm(eagle["target"], 1, eagle["head"]) as llm:
        engine, head = llm.engine, llm.engine.runner.eagle3.head
        weights = {n: t.clone() for n, t in (*head.named_parameters(), *head.named_buffers())}

        def accepted() -> list[int]:
            before = list(engine.spec_stats.accepted_per_pos) or [0] * K  # empty before any
            assert _generate(llm, prompts) == expected
            return [a - b for a, b in zip(engine.spec_stats.accepted_per_pos, before, strict=True)]

        first = accepted()
        assert sum(first) > 0
        for level in (1, 2):
            llm.sleep(level=level)
            cache = llm.engine.runner.eagle3.kv_cache
            assert all(t.untyped_storage().nbytes() == 0 for t in (*cache, *weights_of(head)))
            llm.wake_up(["weights"])
            if level == 2:
                target = load(str(eagle["target"] / "model.safetensors")).items()
                assert engine.runner.update_weights(target) == []
                engine.note_weights_loaded()
            llm.wake_up(["kv_cache"])
            for name, t in (*head.named_parameters(), *head.named_buffers()):
                assert torch.equal(t, weights[name]), name
            assert not any(c.any() for c in llm.engine.runner.eagle3.kv_cache)  # zero-filled
            assert accepted() == first, f"level {level}"


def weights_of(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def test_a_moe_target_drafts_with_a_head(eagle, tmp_path, monkeypatch):
    """A Qwen3-MoE target keeps the head's states too (the same capture in the shared model
    body): at TP 2, over the graphs' padded paths, greedy equals transformers. The head was
    trained for the dense target, so few drafts are accepted: this is about exactness and the
    plumbing, not acceptance."""
    from rank_worker.runner.cuda_graphs import ENV_VAR
    from tests.moe_cases import MIN_ROUTER_MARGIN, load_hf_moe, router_margins
    from tp_engine.testing import build_random_qwen3_moe

    target = build_random_qwen3_moe(
        tmp_path / "moe", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        max_position_embeddings=128, seed=5,
    )  # fmt: skip
    model = load_hf_moe(target)
    prompts = _prompts(3, (5, 9, 14), seed=2)
    expected = hf_greedy(model, prompts, MAX_TOKENS)
    # No token of these sequences sits on a routing near-tie (tests/moe_cases.py).
    margin = router_margins(model, [p + e for p, e in zip(prompts, expected, strict=True)])
    assert margin > MIN_ROUTER_MARGIN
    monkeypatch.setenv(ENV_VAR, "padded")
    with _llm(target, 2, eagle["head"]) as llm:
        assert llm.engine.runner.model.model.capture_layers == (1, 2, 3)
        assert _generate(llm, prompts) == expected
        assert [_generate(llm, [p])[0] for p in prompts] == expected
        assert llm.engine.spec_stats.num_drafts > 0
        assert llm.engine.runner.eagle3.chain_graphs.num_padded_runs > 0
