"""Sleep mode (`tp_engine.features.weights_and_sleep.sleep`, `rank_worker.control.sleep_ops`, `rank_worker.runner.device_sleep`) on CPU.

Memory is accounted from the storages themselves (`DeviceSleep.report`, every rank's through
the MEMORY_REPORT call): what a GPU would give back is what the process stops holding. With the
offline `LLM` at TP = 1 and 2 (one engine per TP size for the module):

- sleep(1): every rank's weight and KV bytes drop to 0 and the host holds exactly the weights;
  wake_up() restores the same bytes, the greedy tokens are those of before, the prefix cache is
  empty and the free-block count is back at its total;
- a request sent while asleep waits (`has_work()` False, the watchdog's view) and runs after wake;
- sleep aborts the running requests; 20 sleep/wake cycles come back to the baseline each time;
- sleep(2) then generate: a clear error until new weights are loaded (TP = 1, where the test can
  load them itself); wake_up(["weights"]) first leaves the engine asleep; rotary tables survive;
- a sleep a rank refuses changes nothing;
- at the runner: the decode graphs are dropped at sleep and captured again once both tags are
  awake (the capture itself is a GPU's; here it is counted), and a forward while asleep raises.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rank_worker.control import sleep_ops as control_sleep
from rank_worker.kv.cache import KVCacheSpec
from rank_worker.runner import model_runner
from rank_worker.runner.device_sleep import SleepTag
from rank_worker.runner.model_runner import ModelRunner, synthetic_plan
from rank_worker.runner_config import RunnerConfig
from rank_worker.tp import TPInfo
from tests.tp_cases import CHECKPOINTS, MAX_MODEL_LEN
from tp_engine import LLM, SamplingParams
from tp_engine.core.sequence import SequenceStatus
from tp_engine.executor.control import ControlRefusedError
from tp_engine.features.weights_and_sleep.sleep import WeightsNotLoadedError

pytestmark = pytest.mark.slow

NUM_KV_BLOCKS = 64
SHARED = list(range(100, 113))  # 13 tokens: 3 full blocks of 4 shared by two prompts
PROMPTS = [[5, 9, 11, 300], SHARED + [7, 8], SHARED + [9], [17] * 9]
LATE = [4, 8, 15, 16, 23]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    from tp_engine.testing import build_random_qwen3

    return str(
        build_random_qwen3(
            tmp_path_factory.mktemp("ckpt") / "sleep",
            max_position_embeddings=MAX_MODEL_LEN,
            **CHECKPOINTS["tied_kv2_oddvocab"],
        )
    )


def make_llm(checkpoint: str, tp: int) -> LLM:
    return LLM(checkpoint, tensor_parallel_size=tp, block_size=4, num_kv_blocks=NUM_KV_BLOCKS,
               max_num_seqs=8, max_num_batched_tokens=MAX_MODEL_LEN)  # fmt: skip


@pytest.fixture(scope="module", params=[1, 2], ids=lambda tp: f"tp{tp}")
def llm(request, checkpoint):
    engine = make_llm(checkpoint, request.param)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(llm) -> list[list[int]]:
    """Greedy tokens of PROMPTS + [LATE] from the engine before any sleep."""
    return generate(llm, PROMPTS + [LATE])


@pytest.fixture(scope="module")
def baseline(llm, reference) -> list[dict[str, int]]:
    """Every rank's bytes before any sleep (after a generation)."""
    return llm.engine.sleep_state.memory_report()


@pytest.fixture(autouse=True)
def awake(request):
    """Each test leaves an awake, serving engine behind, whatever it did."""
    yield
    if "llm" in request.fixturenames:
        llm = request.getfixturevalue("llm")
        if llm.is_sleeping():
            llm.wake_up()
        llm.engine.resume()
        llm.engine.abort_unfinished()
        assert not llm.engine.sleep_state.weights_lost


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]


def num_free_blocks(llm: LLM) -> int:
    return llm.engine.core.scheduler.block_manager.num_free_blocks


def test_level1_releases_and_restores_exact_bytes(llm, baseline, reference):
    engine = llm.engine
    runner = engine.runner
    # Rank 0's bytes counted another way: each parameter and buffer once, by object.
    tensors = {id(t): t for t in [*runner.model.parameters(), *runner.model.buffers()]}
    weights = sum(t.numel() * t.element_size() for t in tensors.values())
    spec = KVCacheSpec.for_model(runner.hf_config, engine.tp, 4, torch.float32)
    assert baseline[0] == {
        "weights": weights, "kv_cache": NUM_KV_BLOCKS * spec.bytes_per_block, "host_backup": 0
    }  # fmt: skip
    assert len(baseline) == engine.tp.size and all(b["weights"] > 0 for b in baseline)

    llm.sleep(level=1)
    assert llm.is_sleeping()
    asleep = engine.sleep_state.memory_report()
    assert asleep == [{"weights": 0, "kv_cache": 0, "host_backup": b["weights"]} for b in baseline]
    llm.wake_up()
    assert not llm.is_sleeping()
    assert engine.sleep_state.memory_report() == baseline
    assert generate(llm, PROMPTS + [LATE]) == reference


def test_outputs_identical_after_sleep_and_wake_with_the_prefix_cache_flushed(llm, reference):
    bm = llm.engine.core.scheduler.block_manager
    hits = bm.prefix_cache_hits
    assert generate(llm, PROMPTS) == reference[: len(PROMPTS)]
    assert bm.prefix_cache_hits > hits  # awake, the same prompts hit the cache
    llm.sleep(1)
    # The K/V the prefix cache described is gone, and so is the index.
    assert not bm.cached and num_free_blocks(llm) == NUM_KV_BLOCKS
    llm.wake_up()
    hits = bm.prefix_cache_hits
    assert generate(llm, PROMPTS) == reference[: len(PROMPTS)]
    assert bm.prefix_cache_hits == hits  # after the wake nothing hit: every prompt computed


def test_a_request_sent_while_asleep_runs_after_wake(llm, reference):
    engine = llm.engine
    llm.sleep(1)
    seq_id = engine.add_request("late", LATE, greedy())[0]
    # Waiting, but nothing can run: the server's watchdog must not call the engine stuck.
    assert engine.has_unfinished() and not engine.has_work()
    assert engine.step().outputs == []
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate([[1, 2, 3]], greedy(), use_tqdm=False)
    assert engine.has_unfinished()  # generate's refusal left the waiting request alone
    llm.wake_up(["kv_cache"])
    assert llm.is_sleeping() and not engine.has_work()  # the weights still sleep
    llm.wake_up(["weights"])
    assert engine.has_work()
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens += [
            t for out in engine.step().outputs if out.seq_id == seq_id for t in out.new_token_ids
        ]
    assert tokens == reference[-1]


def test_sleep_aborts_running_requests(llm):
    engine = llm.engine
    ids = [engine.add_request(f"run{i}", p, greedy(16))[0] for i, p in enumerate(PROMPTS)]
    engine.step()
    engine.step()
    seqs = {s.seq_id: s for s in engine.core.scheduler.running}
    assert set(ids) <= set(seqs) | {s.seq_id for s in engine.core.scheduler.waiting}
    aborted = engine.sleep(1)
    assert sorted(aborted) == sorted(ids)
    assert all(s.status is SequenceStatus.FINISHED_ABORTED for s in seqs.values())
    assert not engine.has_unfinished() and num_free_blocks(llm) == NUM_KV_BLOCKS
    assert engine.sleep(1) == []  # asleep already: a no-op
    assert engine.sleep_state.asleep == {"weights": 1, "kv_cache": 1}


def test_twenty_cycles_come_back_to_the_baseline(llm, baseline, reference):
    for cycle in range(20):
        llm.sleep(1)
        assert llm.is_sleeping()
        llm.wake_up(None if cycle % 2 else ["weights", "kv_cache"])
        assert not llm.is_sleeping()
        assert llm.engine.sleep_state.memory_report() == baseline, f"cycle {cycle}"
        assert num_free_blocks(llm) == NUM_KV_BLOCKS, f"cycle {cycle}"
        if cycle in (0, 19):
            assert generate(llm, PROMPTS) == reference[: len(PROMPTS)], f"cycle {cycle}"


def test_bad_arguments_are_refused_before_anything_is_sent(llm):
    step_id = llm.engine.step_id
    with pytest.raises(ValueError, match="sleep level"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(["weights", "graphs"])
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up("weights")  # type: ignore[arg-type]
    assert llm.engine.step_id == step_id and not llm.is_sleeping()


# -- TP = 1 only: the test reaches into rank 0's runner ----------------------------------------


@pytest.fixture
def llm1(llm):
    """The TP = 1 engine (one process group at a time: no engine of its own)."""
    if llm.engine.tp.size != 1:
        pytest.skip("reaches into rank 0's runner as the only rank's")
    return llm


def test_level2_then_generate_is_a_clear_error_until_weights_are_loaded(llm1, checkpoint):
    llm, engine = llm1, llm1.engine
    reference = generate(llm, PROMPTS)
    rotary = {n: b.clone() for n, b in engine.runner.model.named_buffers()}
    before = engine.sleep_state.memory_report()[0]
    llm.sleep(level=2)
    # Buffers are not loaded from the checkpoint, so they are kept on the host.
    assert engine.sleep_state.memory_report() == [
        {"weights": 0, "kv_cache": 0, "host_backup": sum(b.nbytes for b in rotary.values())}
    ]
    with pytest.raises(RuntimeError, match="weights are asleep"):
        engine.runner.update_weights([])  # would write into released memory
    llm.wake_up(["weights"])
    assert llm.is_sleeping() and engine.sleep_state.asleep == {"kv_cache": 2}
    assert engine.sleep_state.memory_report()[0]["weights"] == before["weights"]
    assert all(torch.equal(b, rotary[n]) for n, b in engine.runner.model.named_buffers())
    assert engine.runner.update_weights(load_file(f"{checkpoint}/model.safetensors").items()) == []
    llm.wake_up(["kv_cache"])
    assert not llm.is_sleeping() and not engine.has_work()
    with pytest.raises(WeightsNotLoadedError, match=r"sleep\(level=2\); load weights first"):
        llm.generate(PROMPTS, greedy(), use_tqdm=False)
    engine.note_weights_loaded()
    assert generate(llm, PROMPTS) == reference


def test_level2_wake_without_a_load_never_generates(llm1, checkpoint):
    llm, engine = llm1, llm1.engine
    llm.sleep(level=1)
    seq_id = engine.add_request("asleep", LATE, greedy())[0]
    llm.sleep(level=2)  # deeper: the host copy goes too
    assert engine.sleep_state.memory_report()[0]["host_backup"] < 10_000
    llm.wake_up()
    # The waiting request stays waiting; new ones are refused; no step computes anything.
    assert not engine.has_work() and engine.step().outputs == []
    assert engine.core.scheduler.waiting[0].seq_id == seq_id
    with pytest.raises(WeightsNotLoadedError):
        engine.add_request("new", [1, 2], greedy())
    engine.runner.update_weights(load_file(f"{checkpoint}/model.safetensors").items())
    engine.note_weights_loaded()
    while engine.has_unfinished():
        engine.step()


def test_a_refused_sleep_changes_nothing(llm1, monkeypatch):
    llm, engine = llm1, llm1.engine
    before = engine.sleep_state.memory_report()
    seq_id = engine.add_request("kept", LATE, greedy())[0]
    engine.step()
    monkeypatch.setattr(control_sleep, "host_memory_available", lambda: 1000)
    with pytest.raises(ControlRefusedError, match=r"rank 0 refused SLEEP: .* 1000 available"):
        llm.sleep(1)
    assert not llm.is_sleeping() and engine.sleep_state.memory_report() == before
    assert engine.core.scheduler.running[0].seq_id == seq_id and engine.has_work()


# -- the runner alone ------------------------------------------------------------------------


def test_graphs_are_dropped_at_sleep_and_captured_again_once_awake(checkpoint, monkeypatch):
    """On a GPU a graph holds the weights' and the cache's addresses, which a wake changes.
    Here graphs are 'on' (the CPU's reason to skip them is removed) and `capture` counted."""
    from rank_worker.runner import graph_setup

    captures, mixed_captures = [], []
    monkeypatch.setattr(graph_setup, "disabled_reason", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(
        model_runner.DecodeGraphRunner, "capture", lambda self, pool: captures.append(self)
    )
    monkeypatch.setattr(
        model_runner.MixedGraphRunner, "capture", lambda self, pool: mixed_captures.append(self)
    )
    config = RunnerConfig(max_model_len=MAX_MODEL_LEN, block_size=4, max_num_seqs=4,
                          max_num_batched_tokens=32, num_kv_blocks=8)  # fmt: skip
    runner = ModelRunner(checkpoint, config, TPInfo(0, 1), "cpu")
    runner.init_kv_cache(8)
    first, first_mixed = runner.graph_runner, runner.mixed_graphs
    assert captures == [first] and mixed_captures == [first_mixed]
    plan = synthetic_plan([(0, 3, [0])])
    logits = runner.execute(plan)
    runner.device_sleep.sleep(1)
    assert runner.graph_runner is None and first.graphs == {} and first.model is None
    assert runner.mixed_graphs is None and first_mixed.model is None
    with pytest.raises(RuntimeError, match=r"rank 0 is asleep .*kv_cache, weights"):
        runner.execute(plan)
    runner.device_sleep.wake_up([SleepTag.WEIGHTS])
    assert captures == [first]  # the cache still sleeps: nothing to capture against
    runner.device_sleep.wake_up([SleepTag.KV_CACHE])
    assert captures == [first, runner.graph_runner] and runner.graph_runner is not first
    assert mixed_captures == [first_mixed, runner.mixed_graphs]
    assert runner.graph_runner.kv_caches is runner.kv_caches
    assert torch.equal(runner.execute(plan), logits)
    runner.release()


def test_level2_then_a_full_update_serves_again_at_every_rank(llm, checkpoint):
    """The RL cycle through the public API (TP 1 and 2): sleep(2), a load refused while the
    weights sleep, wake the weights, a partial load that does not count as new weights, a full
    one that does, wake the cache: the checkpoint's tokens again."""
    from tp_engine.executor.control import ControlRefusedError

    reference = generate(llm, PROMPTS)
    weights = load_file(f"{checkpoint}/model.safetensors")
    llm.sleep(level=2)
    with pytest.raises(ControlRefusedError, match="weights are asleep"):
        llm.load_weights(weights)
    llm.wake_up(["weights"])
    first = next(iter(weights))
    llm.load_weights({first: weights[first]})
    llm.wake_up(["kv_cache"])
    with pytest.raises(WeightsNotLoadedError):
        llm.generate(PROMPTS, greedy(), use_tqdm=False)
    llm.load_weights(weights)
    assert generate(llm, PROMPTS) == reference
