"""`rank_worker.control.weight_group` on one rank, exactly: the background join's states, what the status
and destroy ops answer in each, and an abandoned join that forms after all being left. The join
itself is stood in for (its layout is tested against SGLang's helper in test_sglang_clients)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from rank_worker.control import weight_group as wg
from rank_worker.control.protocol import ControlRefused
from rank_worker.tp import TPInfo

TP = TPInfo(1, 2)  # rank 1 of a TP 2 engine: group rank rank_offset + 1


class Runner:
    device = torch.device("cpu")


class FakeJoins:
    """join_group / leave_group stand-ins: each join waits for `release`, then returns a fresh
    group object (or raises `fail`); left groups are recorded."""

    def __init__(self, monkeypatch) -> None:
        self.release = threading.Event()
        self.fail: Exception | None = None
        self.calls: list[tuple] = []
        self.left: list[Any] = []
        monkeypatch.setattr(wg, "join_group", self.join)
        monkeypatch.setattr(wg, "leave_group", self.left.append)

    def join(self, *args: Any) -> Any:
        self.calls.append(args)
        assert self.release.wait(10)
        if self.fail is not None:
            raise self.fail
        return object()


def init_args(**over: Any) -> dict[str, Any]:
    args = {"master_address": "127.0.0.1", "master_port": 29600, "rank_offset": 1,
            "world_size": 3, "group_name": "g", "backend": None, "timeout_s": None}  # fmt: skip
    return {**args, **over}


def start(runner: Runner, **over: Any) -> None:
    wg._commit_init(runner, wg._prepare_init(runner, TP, init_args(**over)))


def status(runner: Runner, name: str = "g") -> dict[str, Any]:
    return wg._commit_status(runner, wg._prepare_status(runner, TP, {"group_name": name}))


def wait_done(runner: Runner, name: str = "g") -> None:
    assert wg.groups_of(runner).joining[name].done.wait(10)


def test_bad_arguments_are_refused_before_anything_starts(monkeypatch):
    joins, runner = FakeJoins(monkeypatch), Runner()
    for over, match in [
        ({"rank_offset": 0}, "rank 0 is the trainer"),
        ({"world_size": 2}, "do not fit"),
        ({"master_port": 0}, "master_port"),
        ({"timeout_s": 0}, "timeout"),
        ({"backend": "mpi"}, "backend"),
        ({"group_name": ""}, "group_name"),
    ]:
        with pytest.raises(ControlRefused, match=match):
            wg._prepare_init(runner, TP, init_args(**over))
    assert joins.calls == [] and not wg.groups_of(runner).joining


def test_pending_then_joined_with_this_ranks_group_rank(monkeypatch):
    joins, runner = FakeJoins(monkeypatch), Runner()
    start(runner, timeout_s=7)
    assert status(runner) == {"state": "pending", "error": None}
    with pytest.raises(ControlRefused, match="no weights update group"):
        wg.formed_group(runner, "g")  # nothing may use it yet
    with pytest.raises(ControlRefused, match="exists already"):
        wg._prepare_init(runner, TP, init_args())
    joins.release.set()
    wait_done(runner)
    assert status(runner) == {"state": "joined", "error": None}
    group = wg.formed_group(runner, "g")
    assert (group.rank, group.world_size, group.backend) == (2, 3, "gloo")
    assert joins.calls == [("127.0.0.1", 29600, 2, 3, "g", "gloo", 7.0)]
    assert wg._commit_destroy(runner, wg._prepare_destroy(runner, TP, {"group_name": "g"}))
    assert joins.left == [group.pg] and not wg.groups_of(runner).formed


def test_a_failed_join_reports_why_and_keeps_nothing(monkeypatch):
    joins, runner = FakeJoins(monkeypatch), Runner()
    start(runner)
    joins.fail = RuntimeError("connect timed out")
    joins.release.set()
    wait_done(runner)
    assert status(runner) == {"state": "failed", "error": "RuntimeError: connect timed out"}
    groups = wg.groups_of(runner)
    assert not groups.formed and not groups.joining
    start(runner)  # the name is free again


def test_an_abandoned_join_leaves_the_group_once_it_forms(monkeypatch):
    joins, runner = FakeJoins(monkeypatch), Runner()
    start(runner)
    destroy = {"group_name": "g", "missing_ok": True}
    assert wg._commit_destroy(runner, wg._prepare_destroy(runner, TP, destroy)) is True
    assert not wg.groups_of(runner).joining
    joins.release.set()  # the thread still runs: let it form
    for thread in threading.enumerate():
        if thread.name == "join-g":
            thread.join(10)
    assert len(joins.left) == 1 and not wg.groups_of(runner).formed
    # missing_ok: nothing to leave is no refusal; without it, it is one.
    assert wg._prepare_destroy(runner, TP, destroy) == ""
    with pytest.raises(ControlRefused, match="no weights update group"):
        wg._prepare_destroy(runner, TP, {"group_name": "g"})


def test_offline_join_with_nobody_listening_fails_within_its_timeout(tmp_path):
    """`LLM.init_weights_update_group` (which waits, no step running meanwhile) to a port nobody
    listens on: GroupJoinError naming the rank's reason within the timeout, then the engine
    generates and the name is free."""
    import socket
    import time

    from tp_engine import LLM, SamplingParams
    from tp_engine.demo import DEMO_SHAPE
    from tp_engine.executor.control import ControlRefusedError
    from tp_engine.features.weights_and_sleep.weight_updates import JOIN_GRACE_S, GroupJoinError
    from tp_engine.testing import build_random_qwen3

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ckpt = build_random_qwen3(tmp_path / "a", **DEMO_SHAPE)
    with LLM(str(ckpt), num_kv_blocks=16, max_model_len=64) as llm:
        start = time.monotonic()
        with pytest.raises(GroupJoinError, match=r"rank 0: .*'nowhere'|'nowhere'.*rank 0"):
            llm.init_weights_update_group("127.0.0.1", port, 1, 2, "nowhere", timeout_s=2)
        assert time.monotonic() - start < 2 + JOIN_GRACE_S + 2
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        assert len(llm.generate([[5, 9, 11]], params, use_tqdm=False)[0].outputs[0].token_ids) == 3
        with pytest.raises(ControlRefusedError, match="no weights update group"):
            llm.destroy_weights_update_group("nowhere")
