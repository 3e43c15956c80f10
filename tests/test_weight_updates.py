"""Run-time weight updates through the offline `LLM` (`tp_engine.features.weights_and_sleep.weight_updates`,
`rank_worker.control.weight_ops`): the iterator, disk and trainer-group paths, at TP 1, 2 and 4,
dense and MoE (expert parallel at TP 2).

Two random checkpoints of one shape, A and B. The references for "the engine holds B" are
transformers' greedy tokens on B and the checksums of every rank's shard of a fresh load of B
(built here in the test process, as a fresh engine's rank would build it); "in place" is every
parameter of rank 0 keeping its `data_ptr` (the CPU stand-in for captured CUDA graphs).
One engine per (model, TP) serves every test of the module; each test first puts A back.

- each path: A → B gives transformers(B)'s tokens and B's checksums on every rank, in place;
- refusals (unknown name, wrong shape, integer dtype; a disk checkpoint with a wrong shape; a
  trainer announcing a wrong shape): ControlRefusedError naming the tensor and both shapes,
  checksums, tokens, epoch and version unchanged; the refused trainer's broadcasts complete;
- prefix cache: a prompt cached under A is no hit under B (and the planted root without the
  epoch makes it one: the check can fail);
- 20 alternating updates: tokens alternate, free blocks back at baseline each time.
"""

from __future__ import annotations

import multiprocessing as mp
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from rank_worker.control.protocol import ControlOp, parameter_checksum
from rank_worker.models.architectures import build_model
from rank_worker.models.loader import load_weights, safetensors_files
from rank_worker.runner.model_runner import load_hf_config
from rank_worker.tp import TPInfo
from tests.moe_cases import MOE_CHECKPOINTS
from tests.tp_cases import CHECKPOINTS, MAX_MODEL_LEN
from tests.weight_trainer import trainer_main
from tp_engine import LLM, SamplingParams
from tp_engine.executor.control import ControlRefusedError
from tp_engine.server.rank0.replicas import free_port

pytestmark = pytest.mark.slow

# (kind, tp, expert_parallel): one TP 4 case, MoE under expert parallelism at TP 2.
ENGINES = [("dense", 1, False), ("dense", 2, False), ("dense", 4, False), ("moe", 2, True)]
PROMPTS = [[5, 9, 11, 300], [17] * 9, list(range(40, 61))]
MAX_TOKENS = 8
QKV = "model.layers.1.self_attn.q_proj.weight"


def _shape(kind: str) -> dict[str, Any]:
    base = CHECKPOINTS["tied_kv2_oddvocab"] if kind == "dense" else MOE_CHECKPOINTS["moe_e6k2"]
    return {k: v for k, v in base.items() if k != "seed"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    from tp_engine.testing import build_random_qwen3, build_random_qwen3_moe

    root = tmp_path_factory.mktemp("wu")
    out = {}
    for kind, build in (("dense", build_random_qwen3), ("moe", build_random_qwen3_moe)):
        a, b = (
            build(root / f"{kind}_{x}", seed=seed, max_position_embeddings=MAX_MODEL_LEN,
                  **_shape(kind))
            for x, seed in (("a", 11), ("b", 12))
        )  # fmt: skip
        out[kind] = (a, b)
    return out


_HF: dict[Path, list[list[int]]] = {}


def hf_tokens(ckpt: Path) -> list[list[int]]:
    """transformers' greedy tokens on `ckpt` (cached per checkpoint)."""
    if ckpt not in _HF:
        from transformers import AutoModelForCausalLM

        from tests.moe_cases import hf_greedy

        model = AutoModelForCausalLM.from_pretrained(
            ckpt, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        _HF[ckpt] = hf_greedy(model, PROMPTS, MAX_TOKENS)
    return _HF[ckpt]


_REF: dict[tuple, dict[str, int]] = {}


def ref_checksums(ckpt: Path, rank: int, size: int, ep: bool) -> dict[str, int]:
    """Rank `rank`'s shard of a fresh load of `ckpt`, built in this process without a group."""
    key = (ckpt, rank, size, ep)
    if key not in _REF:
        model = build_model(
            load_hf_config(ckpt), TPInfo(rank, size), torch.float32, "cpu",
            enable_expert_parallel=ep,
        )  # fmt: skip
        load_weights(model, ckpt)
        _REF[key] = {n: parameter_checksum(p) for n, p in model.named_parameters()}
    return _REF[key]


def tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in safetensors_files(ckpt):
        out.update(load_file(str(path)))
    return out


class Engine:
    def __init__(self, kind: str, tp: int, ep: bool, a: Path, b: Path) -> None:
        self.kind, self.tp, self.ep, self.a, self.b = kind, tp, ep, a, b
        self.llm = LLM(
            str(a), tensor_parallel_size=tp, enable_expert_parallel=ep, block_size=4,
            num_kv_blocks=96, max_num_seqs=8, max_num_batched_tokens=MAX_MODEL_LEN,
        )  # fmt: skip

    def tokens(self, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    def checksums(self) -> list[dict[str, int]]:
        result = self.llm.engine.control.call(ControlOp.WEIGHT_CHECKSUMS)
        assert result.ok, result.message
        return result.results

    def expected(self, ckpt: Path) -> list[dict[str, int]]:
        return [ref_checksums(ckpt, r, self.tp, self.ep) for r in range(self.tp)]

    def pointers(self) -> dict[str, int]:
        return {n: p.data_ptr() for n, p in self.llm.engine.runner.model.named_parameters()}

    def holds(self, ckpt: Path) -> None:
        """Every rank holds a fresh load of `ckpt` and generates transformers' tokens on it."""
        assert self.checksums() == self.expected(ckpt)
        assert self.tokens() == hf_tokens(ckpt)

    def reset_to_a(self) -> None:
        self.llm.update_weights_from_disk(str(self.a))


@pytest.fixture(
    scope="module", params=ENGINES, ids=lambda c: f"{c[0]}-tp{c[1]}{'-ep' if c[2] else ''}"
)
def engine(request, checkpoints):
    kind, tp, ep = request.param
    a, b = checkpoints[kind]
    eng = Engine(kind, tp, ep, a, b)
    yield eng
    eng.llm.shutdown()


def test_iterator_path(engine: Engine) -> None:
    engine.reset_to_a()
    assert engine.tokens() == hf_tokens(engine.a)
    assert hf_tokens(engine.a) != hf_tokens(engine.b)  # the test can tell A from B
    ptrs, epoch = engine.pointers(), engine.llm.engine.core.scheduler.block_manager.epoch
    new = tensors(engine.b)
    # A lazy iterator, in small buckets: several calls, each validated before it writes.
    n = engine.llm.load_weights(iter(new.items()), weight_version="b1", bucket_bytes=64 << 10)
    assert n == len(new)
    engine.holds(engine.b)
    assert engine.pointers() == ptrs
    assert engine.llm.weight_version == "b1"
    assert engine.llm.engine.core.scheduler.block_manager.epoch > epoch
    # Read back through every rank's shard: the full tensor's first values.
    got = engine.llm.get_weights_by_name(QKV, truncate_size=100)
    assert torch.equal(torch.tensor(got, dtype=torch.float32), new[QKV].flatten()[:100])
    # A dict (sized: validated whole first) in bf16 is cast: equals B rounded to bf16.
    engine.llm.load_weights({n: t.to(torch.bfloat16) for n, t in tensors(engine.a).items()})
    got = engine.llm.get_weights_by_name(QKV, truncate_size=7)
    a_qkv = tensors(engine.a)[QKV].flatten()[:7]
    assert torch.equal(torch.tensor(got, dtype=torch.float32), a_qkv.to(torch.bfloat16).float())
    assert engine.llm.weight_version == "b1"  # None keeps the version


def test_disk_path(engine: Engine) -> None:
    engine.reset_to_a()
    ptrs = engine.pointers()
    engine.llm.update_weights_from_disk(str(engine.b), weight_version="disk-b")
    engine.holds(engine.b)
    engine.llm.update_weights_from_disk(str(engine.a))
    engine.holds(engine.a)
    assert engine.pointers() == ptrs
    assert engine.llm.weight_version == "disk-b"


def _refused_changes_nothing(engine: Engine, update, match: str) -> None:
    bm = engine.llm.engine.core.scheduler.block_manager
    before = (engine.checksums(), bm.epoch, engine.llm.weight_version)
    with pytest.raises(ControlRefusedError, match=match):
        update()
    assert (engine.checksums(), bm.epoch, engine.llm.weight_version) == before


def test_refusals_leave_the_weights_intact(engine: Engine, tmp_path: Path) -> None:
    engine.reset_to_a()
    new = tensors(engine.b)
    good = dict(new)
    name = "model.layers.0.mlp.down_proj.weight" if engine.kind == "dense" else QKV
    bad_shape = dict(good, **{name: torch.zeros(3, 5)})
    expected_shape = tuple(new[name].shape)
    cases = [
        ({**good, "model.layers.9.nope.weight": torch.zeros(2)}, r"'model\.layers\.9\.nope\.weight'.*no weight"),
        (bad_shape, f"{re.escape(name)}.*{re.escape('(3, 5)')}.*{re.escape(str(expected_shape))}"),
        ({**good, name: new[name].to(torch.int32)}, f"{re.escape(name)}.*int32"),
    ]  # fmt: skip
    for batch, match in cases:
        # The bad tensor comes last: earlier tensors of the batch must not have been written.
        _refused_changes_nothing(engine, lambda b=batch: engine.llm.load_weights(b), match)
        assert engine.tokens() == hf_tokens(engine.a)
    # Disk: a checkpoint with one tensor of the wrong shape.
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    from safetensors.torch import save_file

    save_file({**new, name: torch.zeros(3, 5)}, str(bad_dir / "model.safetensors"))
    _refused_changes_nothing(
        engine, lambda: engine.llm.update_weights_from_disk(str(bad_dir)), r"\(3, 5\)"
    )
    assert engine.tokens() == hf_tokens(engine.a)


def test_distributed_path(engine: Engine) -> None:
    engine.reset_to_a()
    ctx = mp.get_context("spawn")
    commands, replies = ctx.Queue(), ctx.Queue()
    port, world = free_port("127.0.0.1"), 1 + engine.tp
    trainer = ctx.Process(
        target=trainer_main, args=(port, world, "wug", commands, replies), daemon=True
    )
    trainer.start()
    try:
        engine.llm.init_weights_update_group("127.0.0.1", port, 1, world, "wug", timeout_s=60)
        assert replies.get(timeout=60) == ("ready",)
        new = tensors(engine.b)
        metas = [[n, "float32", list(t.shape)] for n, t in new.items()]
        ptrs = engine.pointers()
        commands.put(("send", str(engine.b), metas))
        engine.llm.update_weights_from_distributed(
            [m[0] for m in metas], [m[1] for m in metas], [m[2] for m in metas],
            group_name="wug", weight_version="dist-b",
        )  # fmt: skip
        assert replies.get(timeout=60)[0] == "sent"
        engine.holds(engine.b)
        assert engine.pointers() == ptrs and engine.llm.weight_version == "dist-b"

        # Refused (a wrong shape announced, and sent): every rank still drains the broadcasts.
        bad = [list(m) for m in metas]
        bad[1][2] = [3, 5]
        commands.put(("send", str(engine.a), bad))
        before = engine.checksums()
        with pytest.raises(ControlRefusedError, match=rf"{bad[1][0]}.*\(3, 5\)"):
            engine.llm.update_weights_from_distributed(
                [m[0] for m in bad], [m[1] for m in bad], [m[2] for m in bad], group_name="wug"
            )
        reply = replies.get(timeout=30)  # the trainer's broadcasts completed: no hang
        assert reply[0] == "sent", reply
        assert engine.checksums() == before
        assert engine.tokens() == hf_tokens(engine.b)
        engine.llm.destroy_weights_update_group("wug")
        commands.put(("stop",))
        assert replies.get(timeout=30) == ("stopped",)
    finally:
        trainer.join(timeout=30)
        if trainer.is_alive():
            trainer.kill()
    with pytest.raises(ControlRefusedError, match="no weights update group"):
        engine.llm.destroy_weights_update_group("wug")


def _hits(engine: Engine) -> int:
    return engine.llm.engine.stats().prefix_cache_hits


@pytest.mark.parametrize("flush", [False, True])
def test_prefix_cache_never_serves_the_old_weights(engine: Engine, flush: bool) -> None:
    engine.reset_to_a()
    prompt = [PROMPTS[2]]
    first = engine.tokens(prompt)
    hits = _hits(engine)
    assert engine.tokens(prompt) == first and _hits(engine) > hits  # the prompt is cached
    hits = _hits(engine)
    engine.llm.load_weights(tensors(engine.b), flush_cache=flush)
    assert engine.tokens(prompt) == [hf_tokens(engine.b)[2]]
    assert _hits(engine) == hits  # nothing computed under A was reused


def test_planted_root_without_the_epoch_is_caught(engine: Engine, monkeypatch) -> None:
    """The prefix-cache test above fails when the epoch is left out of the chain's root."""
    if engine.tp != 1:
        pytest.skip("one TP size is enough to show the check can fail")
    import tp_engine.core.kv.block_manager as bm_module

    monkeypatch.setattr(bm_module, "prefix_cache_root", lambda epoch, tags=(): None)
    engine.reset_to_a()
    prompt = [PROMPTS[2]]
    engine.tokens(prompt)
    hits = _hits(engine)
    engine.llm.load_weights(tensors(engine.b), flush_cache=False)
    tokens = engine.tokens(prompt)
    assert _hits(engine) > hits  # stale K/V of A served under B
    assert tokens != [hf_tokens(engine.b)[2]]


def test_alternating_updates_return_to_baseline(engine: Engine) -> None:
    if engine.tp != 2:
        pytest.skip("one TP size is enough for the soak")
    engine.reset_to_a()
    a, b = tensors(engine.a), tensors(engine.b)
    engine.tokens(PROMPTS[:1])
    bm = engine.llm.engine.core.scheduler.block_manager
    baseline = bm.num_free_blocks
    for cycle in range(20):
        ckpt, weights = (engine.b, b) if cycle % 2 == 0 else (engine.a, a)
        engine.llm.load_weights(weights, weight_version=str(cycle))
        assert engine.tokens(PROMPTS[:1]) == hf_tokens(ckpt)[:1], f"cycle {cycle}"
        assert bm.num_free_blocks == baseline, f"cycle {cycle}"
    assert engine.llm.weight_version == "19"


def test_requests_kept_across_an_update_continue_and_share_nothing(engine: Engine) -> None:
    """Pause "keep" around an update (the RL default of SGLang's in-place pause): the frozen
    requests continue on the new weights and finish; none of their K/V (computed, or attended
    to, under the old weights) is ever a hit, even with the cache not flushed; a fresh request
    with the same prompt gets transformers' tokens on the new weights."""
    from tp_engine.core.engine_states import PauseMode

    engine.reset_to_a()
    core = engine.llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = PROMPTS[2]  # 21 tokens: 5 full blocks
    kept = core.add_request("kept", prompt, params)[0]
    tokens: list[int] = []
    while len(tokens) < 2:
        tokens += [
            t for out in core.step().outputs if out.seq_id == kept for t in out.new_token_ids
        ]
    core.pause(PauseMode.KEEP)
    assert tokens == hf_tokens(engine.a)[2][: len(tokens)]  # computed under A so far
    engine.llm.load_weights(tensors(engine.b), flush_cache=False)
    core.resume()
    while core.has_unfinished():
        tokens += [
            t for out in core.step().outputs if out.seq_id == kept for t in out.new_token_ids
        ]
    assert len(tokens) == MAX_TOKENS
    hits = _hits(engine)
    assert engine.tokens([prompt]) == [hf_tokens(engine.b)[2]]
    assert _hits(engine) == hits
