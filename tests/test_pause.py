"""Pausing a running engine (`LLMEngine.pause`, `tp_engine.core.engine_states`), step by step.

Every mode against an undisturbed run of the same greedy requests (TP = 1, CPU, float32), with
synchronous and asynchronous scheduling: "keep" freezes the running requests and continues them
to the same tokens, "wait" lets them finish while new ones wait, "abort" ends them with a prefix
of their tokens. In every mode a request added while paused waits, then runs after `resume`.
"""

from __future__ import annotations

import pytest

from tests.tp_cases import CHECKPOINTS, MAX_MODEL_LEN
from tp_engine import LLM, SamplingParams
from tp_engine.core.engine_states import PauseMode
from tp_engine.core.sequence import SequenceStatus

pytestmark = pytest.mark.slow

PROMPTS = [[5, 9, 2, 7], [11, 3, 8, 1, 6, 4, 2], [7, 7, 1]]
LATE = [4, 8, 15, 16, 23]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tp_engine.testing import build_random_qwen3

    return build_random_qwen3(
        tmp_path_factory.mktemp("ckpt") / "pause",
        max_position_embeddings=MAX_MODEL_LEN,
        **CHECKPOINTS["tied_kv2_oddvocab"],
    )


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(model_dir, request):
    engine = LLM(str(model_dir), block_size=4, num_kv_blocks=64, max_num_seqs=8,
                 async_scheduling=request.param)  # fmt: skip
    yield engine
    engine.shutdown()


@pytest.fixture(autouse=True)
def resumed(llm):
    """Each test starts and ends with a serving engine, whatever it left behind."""
    yield
    llm.engine.resume()
    for seq in list(llm.engine.core.scheduler.running) + list(llm.engine.core.scheduler.waiting):
        llm.engine.abort_request(seq.seq_id)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def expected(llm) -> list[list[int]]:
    outs = llm.generate(PROMPTS + [LATE], greedy(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


class Run:
    """Requests added to the engine by hand, with their tokens as steps return them."""

    def __init__(self, llm, tag: str) -> None:
        self.engine = llm.engine
        self.tag = tag
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str | None] = {}

    def add(self, name: str, prompt: list[int]) -> str:
        seq_id = self.engine.add_request(f"{self.tag}-{name}", prompt, greedy())[0]
        self.tokens[seq_id] = []
        return seq_id

    def step(self) -> int:
        """One step; returns how many tokens it delivered."""
        outs = self.engine.step().outputs
        for out in outs:
            self.tokens[out.seq_id] += out.new_token_ids
            if out.finish_reason is not None:
                self.finish[out.seq_id] = out.finish_reason
        return sum(len(out.new_token_ids) for out in outs)

    def until(self, done) -> None:
        for _ in range(200):
            if done():
                return
            self.step()
        raise AssertionError("the engine did not get there in 200 steps")

    def finish_all(self) -> None:
        self.until(lambda: not self.engine.has_unfinished())


def started(run: Run, ids: list[str], n: int = 2):
    return lambda: all(len(run.tokens[i]) >= n for i in ids)


def test_keep_freezes_running_requests_and_continues_them_exactly(llm):
    want = expected(llm)
    run = Run(llm, "keep")
    ids = [run.add(str(i), p) for i, p in enumerate(PROMPTS)]
    run.until(started(run, ids))
    assert llm.engine.pause(PauseMode.KEEP) == []
    run.step()  # what the step in flight had sampled comes out now; then nothing moves
    frozen = {i: list(t) for i, t in run.tokens.items()}
    late = run.add("late", LATE)
    for _ in range(5):
        assert run.step() == 0
    assert not llm.engine.has_work() and llm.engine.has_unfinished()
    assert run.tokens == {**frozen, late: []}
    assert llm.engine.core.scheduler.get(late).status is SequenceStatus.WAITING
    llm.engine.resume()
    run.finish_all()
    assert [run.tokens[i] for i in ids + [late]] == want
    llm.engine.core.scheduler.check_integrity()


def test_wait_lets_running_requests_finish_and_holds_new_ones(llm):
    want = expected(llm)
    run = Run(llm, "wait")
    ids = [run.add(str(i), p) for i, p in enumerate(PROMPTS)]
    run.until(started(run, ids, 1))
    llm.engine.pause(PauseMode.WAIT)
    late = run.add("late", LATE)
    run.until(lambda: not llm.engine.has_work())
    assert [run.tokens[i] for i in ids] == want[:3]
    assert all(run.finish[i] == "length" for i in ids)
    assert run.tokens[late] == [] and llm.engine.has_unfinished()
    llm.engine.resume()
    run.finish_all()
    assert run.tokens[late] == want[3]


def test_abort_ends_requests_with_what_they_have(llm):
    want = expected(llm)
    run = Run(llm, "abort")
    ids = [run.add(str(i), p) for i, p in enumerate(PROMPTS)]
    run.until(started(run, ids))
    aborted = llm.engine.pause(PauseMode.ABORT)
    assert sorted(aborted) == sorted(ids)
    run.step()  # the step in flight's tokens, if any
    for i, seq_id in enumerate(ids):
        got = run.tokens[seq_id]
        assert 2 <= len(got) < MAX_TOKENS and got == want[i][: len(got)]
        assert llm.engine.core.scheduler.get(seq_id) is None  # gone, blocks freed
    assert llm.engine.core.scheduler.block_manager.usage == 0.0
    late = run.add("late", LATE)
    assert run.step() == 0 and not llm.engine.has_work()
    llm.engine.resume()
    run.finish_all()
    assert run.tokens[late] == want[3]


def test_generate_while_paused_is_refused(llm):
    llm.engine.pause(PauseMode.WAIT)
    with pytest.raises(RuntimeError, match="paused \\(wait\\): resume it first"):
        llm.generate([PROMPTS[0]], greedy(), use_tqdm=False)
    assert not llm.engine.has_unfinished()  # the refused request left nothing behind
    llm.engine.resume()
    assert len(llm.generate([PROMPTS[0]], greedy(), use_tqdm=False)[0].outputs[0].token_ids) == 8


def test_unknown_pause_mode_is_refused_by_name():
    with pytest.raises(ValueError, match=r"'stop'.*abort, wait, keep"):
        PauseMode.parse("stop")
