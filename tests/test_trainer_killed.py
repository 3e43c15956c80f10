"""A trainer killed in the middle of its broadcasts (`update_weights_from_distributed`).

Some tensors were written, the rest never came: the ranks may now hold a mix of old and new
weights. The update raises `EngineInconsistentError` (no hang: the dead peer breaks the
group's receives), the engine then refuses to generate rather than serve the mix, and stays
alive: a load of every weight (here from disk) makes it whole and it serves the new weights.
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.tp_cases import CHECKPOINTS, MAX_MODEL_LEN, hf_greedy
from tests.weight_trainer import checkpoint_metas, spawn_trainer
from tp_engine import LLM, SamplingParams
from tp_engine.executor.control import ControlRefusedError, EngineInconsistentError

pytestmark = pytest.mark.slow

PROMPT = [5, 9, 11, 300]


def test_a_trainer_killed_mid_broadcast_leaves_the_engine_refusing_until_a_full_load(tmp_path):
    from tp_engine.testing import build_random_qwen3

    shape = {k: v for k, v in CHECKPOINTS["tied_kv2_oddvocab"].items() if k != "seed"}
    a = build_random_qwen3(tmp_path / "a", max_position_embeddings=MAX_MODEL_LEN, seed=1, **shape)
    b = build_random_qwen3(tmp_path / "b", max_position_embeddings=MAX_MODEL_LEN, seed=2, **shape)
    metas = checkpoint_metas(b)
    trainer = spawn_trainer(2, "rl")
    commands, replies, port = trainer.commands, trainer.replies, trainer.port
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(str(a), block_size=4, num_kv_blocks=64) as llm:
        llm.init_weights_update_group("127.0.0.1", port, 1, 2, "rl", timeout_s=60)
        assert replies.get(timeout=60) == ("ready",)
        commands.put(("die_after", str(b), metas, 3))
        with pytest.raises(EngineInconsistentError, match="refuses to step"):
            llm.update_weights_from_distributed(
                [m[0] for m in metas], [m[1] for m in metas], [m[2] for m in metas],
                group_name="rl",
            )  # fmt: skip
        trainer.process.join(30)
        with pytest.raises(EngineInconsistentError):
            llm.generate([PROMPT], greedy, use_tqdm=False)
        with pytest.raises(ControlRefusedError):  # a partial load is checked as ever...
            llm.load_weights(
                {"no.such.weight": load_file(str(b / "model.safetensors"))[metas[0][0]]}
            )
        first = metas[0][0]
        llm.load_weights({first: load_file(str(b / "model.safetensors"))[first]})
        with pytest.raises(EngineInconsistentError):  # ...and one that is not whole repairs nothing
            llm.generate([PROMPT], greedy, use_tqdm=False)
        llm.update_weights_from_disk(str(b))
        out = llm.generate([PROMPT], greedy, use_tqdm=False)
        assert out[0].outputs[0].token_ids == hf_greedy(b, [PROMPT], 6)[0]
