"""An exception in a control call's prepare is a refusal naming the rank and the exception, and
the engine serves on; one in its commit marks the engine inconsistent: `EngineInconsistentError`
naming the rank and the reason, every later step and call refused, shutdown still orderly.

Its own module: the engine it breaks is its own, and a TP = 1 engine in this process, so that the
op table can be patched (workers are separate processes, out of a monkeypatch's reach), and it
must not share the process with another module's process group.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rank_worker.control import protocol as rank_control
from rank_worker.control.protocol import ControlOp, ControlOutcome, OpHandler
from tests.test_control_calls import CKPT, greedy, make_llm
from tests.tp_cases import build_checkpoints
from tp_engine.executor.control import EngineInconsistentError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_checkpoints(tmp_path_factory.mktemp("ckpt"))[CKPT]


def _failing_commit(runner, prepared):
    raise RuntimeError("disk full halfway")


def _raising_prepare(runner, tp, args):
    return {}["missing"]


def test_a_failed_commit_marks_the_engine_inconsistent(checkpoint, monkeypatch):
    # One rank, in process, so that the op table can be patched.
    llm = make_llm(checkpoint, 1)
    try:
        before = llm.generate([[1, 2, 3]], greedy(4), use_tqdm=False)[0].outputs[0].token_ids
        # Any exception in prepare is a refusal naming the rank and the exception: the engine
        # serves on.
        monkeypatch.setitem(
            rank_control._HANDLERS,
            ControlOp.CHECK_NAMES,
            OpHandler(_raising_prepare, _failing_commit),
        )
        refused = llm.engine.control.call(ControlOp.CHECK_NAMES, {"names": []})
        assert refused.outcome is ControlOutcome.REFUSED
        assert refused.message == "rank 0 refused CHECK_NAMES: KeyError: 'missing'"
        again = llm.generate([[1, 2, 3]], greedy(4), use_tqdm=False)[0].outputs[0].token_ids
        assert again == before

        # Every rank's commit fails.
        monkeypatch.setitem(
            rank_control._HANDLERS,
            ControlOp.CHECK_NAMES,
            OpHandler(rank_control._prepare_check_names, _failing_commit),
        )
        with pytest.raises(EngineInconsistentError, match="rank 0 failed to commit") as err:
            llm.engine.control.call(ControlOp.CHECK_NAMES, {"names": []})
        assert err.value.result.outcome is ControlOutcome.COMMIT_FAILED
        assert "RuntimeError: disk full halfway" in err.value.result.message
        with pytest.raises(EngineInconsistentError):
            llm.generate([[1, 2, 3]], greedy(2), use_tqdm=False)
        with pytest.raises(EngineInconsistentError):
            llm.engine.control.call(ControlOp.CHECK_NAMES, {"names": []})
        # Weight loads (and checksums, to see what each rank holds) are still taken: a load
        # of every weight is what repairs the engine (tests/test_trainer_killed.py).
        assert llm.engine.control.call(ControlOp.WEIGHT_CHECKSUMS).ok
    finally:
        llm.shutdown()
