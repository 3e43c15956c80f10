"""Sleep mode and run-time weight updates under pipeline parallelism, through the offline `LLM`,
against transformers (float32, CPU, gloo).

TP 1 x PP 2 on two random dense 3-layer checkpoints of one shape, A and B, with a tied head:
stage 0 holds the embedding and layers 0-1, stage 1 layer 2, the final norm and its own copy of
the embedding as the head (`model.embed_tokens.weight` loaded into `lm_head.weight`). One
engine serves the module; each test starts from A, awake.

- sleep(1) / wake: each rank's own stage's weight and KV bytes drop to 0 (the host holds
  exactly that stage's weights) and come back; the stages' byte counts differ (each holds its
  own layers); the greedy tokens after wake are transformers' on A;
- sleep(2), a load of every tensor rank 0's stage holds (none of stage 1's) does not count as
  new weights (generate still refuses: stage 1's weights are zeros), a load of all of B does:
  transformers' tokens on B, so stage 1 took layer 2, the norm and the tied head from B;
- disk: A → B → A, each transformers' tokens; a lazy iterator of B's tensors likewise;
- get_weights_by_name answers from the stage that holds the tensor (stage 1's layer, the norm)
  with the checkpoint's values, and still refuses an unknown name;
- a trainer's group (1 + TP x PP ranks): B broadcast to both stages; a wrong shape for a stage-1
  tensor is refused by rank 1 alone and every rank drains the broadcasts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.moe_cases import hf_greedy
from tests.tp_cases import MAX_MODEL_LEN
from tp_engine import LLM, SamplingParams
from tp_engine.executor.control import ControlRefusedError
from tp_engine.features.weights_and_sleep.sleep import WeightsNotLoadedError

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
NUM_KV_BLOCKS = 64
SHAPE = dict(hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
             intermediate_size=64, tie_word_embeddings=True)  # fmt: skip
PROMPTS = [[5, 9, 11, 300], [17] * 9, list(range(40, 61))]
# What stage 1 (the last of two over 3 layers: vLLM's split (0, 2), (2, 3)) holds alone.
STAGE1_ONLY = ("model.layers.2.", "model.norm.")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    from tp_engine.testing import build_random_qwen3

    root = tmp_path_factory.mktemp("pp_rl")
    return tuple(
        build_random_qwen3(root / name, seed=seed, max_position_embeddings=MAX_MODEL_LEN, **SHAPE)
        for name, seed in (("a", 41), ("b", 42))
    )  # type: ignore[return-value]


@pytest.fixture(scope="module")
def hf(checkpoints) -> dict[Path, list[list[int]]]:
    """transformers' greedy tokens on A and on B."""
    from transformers import Qwen3ForCausalLM

    out = {}
    for ckpt in checkpoints:
        model = Qwen3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        out[ckpt] = hf_greedy(model, PROMPTS, MAX_TOKENS)
    assert out[checkpoints[0]] != out[checkpoints[1]]  # the update must be visible
    return out


@pytest.fixture(scope="module")
def llm(checkpoints):
    engine = LLM(
        str(checkpoints[0]), tensor_parallel_size=1, pipeline_parallel_size=2, block_size=4,
        num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=8, max_num_batched_tokens=MAX_MODEL_LEN,
    )  # fmt: skip
    yield engine
    engine.shutdown()


@pytest.fixture(autouse=True)
def starts_from_a(llm, checkpoints):
    """Each test starts awake, on A."""
    if llm.is_sleeping():
        llm.wake_up()
    llm.update_weights_from_disk(str(checkpoints[0]))
    assert not llm.engine.sleep_state.weights_lost
    yield


def tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / "model.safetensors"))


def generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_level1_sleeps_and_wakes_each_stage(llm, checkpoints, hf) -> None:
    sleep_state = llm.engine.sleep_state
    assert generate(llm) == hf[checkpoints[0]]
    baseline = sleep_state.memory_report()
    assert len(baseline) == 2 and all(b["weights"] > 0 and b["kv_cache"] > 0 for b in baseline)
    assert baseline[0]["weights"] != baseline[1]["weights"]  # each stage holds its own layers
    llm.sleep(level=1)
    assert llm.is_sleeping()
    asleep = sleep_state.memory_report()
    assert asleep == [{"weights": 0, "kv_cache": 0, "host_backup": b["weights"]} for b in baseline]
    llm.wake_up()
    assert not llm.is_sleeping()
    assert sleep_state.memory_report() == baseline
    assert generate(llm) == hf[checkpoints[0]]
    # Twice more, the second time waking the tags one by one.
    llm.sleep(level=1)
    llm.wake_up(["weights"])
    assert llm.is_sleeping()
    llm.wake_up(["kv_cache"])
    assert generate(llm) == hf[checkpoints[0]]


def test_level2_serves_again_only_once_every_stage_is_loaded(llm, checkpoints, hf) -> None:
    b = checkpoints[1]
    weights = tensors(b)
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    # Every tensor stage 0 holds, none that only stage 1 holds: rank 0's own map is full,
    # stage 1's is not (its layer and norm are zeros).
    stage0 = {n: t for n, t in weights.items() if not n.startswith(STAGE1_ONLY)}
    assert len(stage0) < len(weights)
    llm.load_weights(stage0)
    llm.wake_up(["kv_cache"])
    assert llm.engine.sleep_state.weights_lost
    with pytest.raises(WeightsNotLoadedError):
        generate(llm)
    llm.load_weights(weights)
    assert not llm.engine.sleep_state.weights_lost
    assert generate(llm) == hf[b]


def test_disk_and_iterator_updates(llm, checkpoints, hf) -> None:
    a, b = checkpoints
    llm.update_weights_from_disk(str(b))
    assert generate(llm) == hf[b]
    llm.update_weights_from_disk(str(a))
    assert generate(llm) == hf[a]
    # A lazy iterator, several buckets (each its own call).
    llm.load_weights(iter(tensors(b).items()), bucket_bytes=4096)
    assert generate(llm) == hf[b]


def test_get_weights_by_name_answers_from_the_stage_that_holds_it(llm, checkpoints) -> None:
    b = checkpoints[1]
    llm.update_weights_from_disk(str(b))
    weights = tensors(b)
    for name in (
        "model.embed_tokens.weight",  # stage 0's (stage 1's head copy too)
        "model.layers.0.self_attn.q_proj.weight",  # stage 0's, a packed part
        "model.layers.2.mlp.up_proj.weight",  # stage 1's, a packed part
        "model.layers.2.self_attn.o_proj.weight",
        "model.norm.weight",  # stage 1's
    ):
        got = llm.get_weights_by_name(name, truncate_size=50)
        assert got == weights[name].flatten()[:50].tolist(), name
    with pytest.raises(ControlRefusedError, match="not a checkpoint tensor"):
        llm.get_weights_by_name("model.layers.7.mlp.up_proj.weight")


def test_trainer_group_path(llm, checkpoints, hf) -> None:
    """A trainer (rank 0 of its group) broadcasts B to every engine rank, both stages (group
    ranks 1 and 2); a shape wrong for a stage-1 tensor is refused by stage 1 alone, and every
    rank still drains the broadcasts (the trainer finishes)."""
    import multiprocessing as mp
    import socket

    from tests.weight_trainer import trainer_main

    a, b = checkpoints
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    commands, replies = ctx.Queue(), ctx.Queue()
    world = 1 + 2  # the trainer, then TP 1 x PP 2
    trainer = ctx.Process(
        target=trainer_main, args=(port, world, "ppg", commands, replies), daemon=True
    )
    trainer.start()
    try:
        llm.init_weights_update_group("127.0.0.1", port, 1, world, "ppg", timeout_s=60)
        assert replies.get(timeout=60) == ("ready",)
        metas = [[n, "float32", list(t.shape)] for n, t in tensors(b).items()]

        def update(announced: list) -> None:
            commands.put(("send", str(b), announced))
            llm.update_weights_from_distributed(
                [m[0] for m in announced], [m[1] for m in announced],
                [m[2] for m in announced], group_name="ppg",
            )  # fmt: skip

        bad = [list(m) for m in metas]
        [i] = [k for k, m in enumerate(bad) if m[0] == "model.layers.2.mlp.down_proj.weight"]
        bad[i][2] = [3, 5]
        with pytest.raises(
            ControlRefusedError, match=r"rank 1.*layers\.2\.mlp\.down_proj.*\(3, 5\)"
        ):
            update(bad)
        assert replies.get(timeout=30)[0] == "sent"  # drained: no hang
        assert generate(llm) == hf[a]
        update(metas)
        assert replies.get(timeout=60)[0] == "sent"
        assert generate(llm) == hf[b]
        llm.destroy_weights_update_group("ppg")
        commands.put(("stop",))
        assert replies.get(timeout=30) == ("stopped",)
    finally:
        trainer.join(timeout=30)
        if trainer.is_alive():
            trainer.kill()
