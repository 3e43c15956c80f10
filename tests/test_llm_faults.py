"""A rank that fails mid-run: `generate` raises an error naming it, nothing hangs or leaks.

Its own module, so that no other test's process group is alive when these start theirs.
"""

from __future__ import annotations

import os
import threading

import pytest

from tests.server_harness import shm_entries
from tests.tp_cases import build_checkpoints
from tp_engine import LLM, SamplingParams
from tp_engine.engine import EngineDeadError

pytestmark = pytest.mark.slow


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory.mktemp("ckpt"))


@pytest.mark.parametrize(
    ("kind", "async_scheduling"),
    [("raise", False), ("exit", False), ("raise", True), ("exit", True)],
    ids=["raise", "exit", "raise-async", "exit-async"],
)
def test_a_failing_worker_fails_generate_naming_the_rank(
    checkpoints, monkeypatch, kind, async_scheduling
):
    # With asynchronous scheduling the failure hits while rank 0 has a step in flight.
    before = shm_entries([os.getpid()])  # rank 0 is this process
    monkeypatch.setenv("TP_ENGINE_FAULT", f"rank=1,step=2,kind={kind}")
    llm = LLM(
        str(checkpoints["tied_kv2_oddvocab"]),
        tensor_parallel_size=2,
        block_size=4,
        num_kv_blocks=64,
        async_scheduling=async_scheduling,
    )
    workers = list(llm._ranks.group.procs)
    with pytest.raises(EngineDeadError, match=r"rank 1") as info:
        llm.generate([[1, 2, 3, 4, 5]] * 3, greedy(8), use_tqdm=False)
    assert info.value.rank == 1
    if kind == "raise":
        assert "injected fault on rank 1 at step 2" in str(info.value)
    assert all(p.poll() is not None for p in workers), "a worker outlived the failed engine"
    assert shm_entries([os.getpid(), *(p.pid for p in workers)]) <= before
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2]], greedy(2), use_tqdm=False)


def test_a_worker_that_dies_before_joining_is_named_at_once(checkpoints, monkeypatch, tmp_path):
    # A child interpreter that exits during start-up, before it can join the group (rank 0 has
    # imported everything already, so only the children see this sitecustomize).
    (tmp_path / "sitecustomize.py").write_text("import os\nos._exit(1)\n")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) exited with code 1 before joining"):
        LLM(str(checkpoints["tied_kv2_oddvocab"]), tensor_parallel_size=2, num_kv_blocks=8)


def test_a_malformed_fault_spec_is_refused_before_any_rank_starts(checkpoints, monkeypatch):
    monkeypatch.setenv("TP_ENGINE_FAULT", "not a fault spec")
    with pytest.raises(ValueError, match="TP_ENGINE_FAULT"):
        LLM(str(checkpoints["tied_kv2_oddvocab"]), tensor_parallel_size=2, num_kv_blocks=8)


def test_a_second_kill_returns_only_once_the_group_directory_is_gone(tmp_path, monkeypatch):
    """A watchdog thread's `kill` (followed by `os._exit`) while the main thread is still
    removing the rendezvous directory must wait for it, or the directory is left behind."""
    from rank_worker.dist import local_group

    run_dir = tmp_path / "tpe-group-x"
    run_dir.mkdir()
    removing, finish = threading.Event(), threading.Event()

    def slow_remove(path: str) -> None:
        removing.set()
        finish.wait(5.0)
        os.rmdir(path)

    monkeypatch.setattr(local_group, "remove_tree", slow_remove)
    group = local_group.LocalGroup(procs=[], run_dir=str(run_dir))
    first = threading.Thread(target=group.kill)
    first.start()
    assert removing.wait(5.0)
    second = threading.Thread(target=group.kill)
    second.start()
    second.join(0.3)
    assert second.is_alive(), "the second kill returned while the directory was being removed"
    finish.set()
    first.join(5.0)
    second.join(5.0)
    assert not run_dir.exists()


def test_remove_tree_removes_a_file_written_again_during_the_removal(tmp_path, monkeypatch):
    """A rank leaving the group can write the store's file again between rmtree's unlink and
    its rmdir; one rmtree then leaves the directory, the retry does not."""
    import shutil

    from rank_worker.dist import local_group

    run_dir = tmp_path / "tpe-group-y"
    run_dir.mkdir()
    real_rmtree, calls = shutil.rmtree, []

    def racing_rmtree(path, ignore_errors=False):
        calls.append(path)
        real_rmtree(path, ignore_errors=ignore_errors)
        if len(calls) == 1:  # the late writer: the directory and its file are back
            os.makedirs(path)
            (run_dir / "store").write_bytes(b"x")

    monkeypatch.setattr(local_group.shutil, "rmtree", racing_rmtree)
    local_group.remove_tree(str(run_dir))
    assert not run_dir.exists() and len(calls) == 2
