"""Rank 0 parses requests' output constraints off its engine loop
(`tp_engine.server.rank0.constraint_parses`): verdicts by the request's field, a slow parse
holding its own request only, the deadline, aborts and a parser's own failure."""

from __future__ import annotations

import threading
import time

import pytest

from tp_engine.server.messages import AddRequest
from tp_engine.server.rank0 import constraint_parses
from tp_engine.server.rank0.constraint_parses import ConstraintParses, Verdict


def _add(request_id: str, regex: str, param: str = "regex") -> AddRequest:
    return AddRequest(request_id, [1, 2, 3], {}, constraint_checks={param: {"regex": regex}})


def _wait_for(parses: ConstraintParses, n: int, timeout_s: float = 20.0) -> list[Verdict]:
    verdicts: list[Verdict] = []
    deadline = time.monotonic() + timeout_s
    while len(verdicts) < n and time.monotonic() < deadline:
        verdicts += parses.take()
        time.sleep(0.005)
    return verdicts


def test_a_constraint_that_parses_is_admitted_and_one_that_does_not_is_refused_by_field():
    parses = ConstraintParses(timeout_s=30.0)
    parses.submit(_add("good", "[a-z]+"))
    parses.submit(_add("bad", "[a-z", param="response_format.regex"))
    assert parses
    verdicts = {v.msg.request_id: v for v in _wait_for(parses, 2)}
    assert verdicts["good"].why is None and verdicts["good"].param is None
    bad = verdicts["bad"]
    assert bad.param == "response_format.regex"
    assert bad.why is not None and "response_format.regex" in bad.why
    assert not parses


@pytest.fixture
def slow_parser(monkeypatch):
    """`parse_refusal` that blocks on "slow" until the test releases it."""
    release = threading.Event()
    real = constraint_parses.parse_refusal

    def parse(fields, param):
        if fields.get("regex") == "slow":
            release.wait(30)
        return real(fields, param)

    monkeypatch.setattr(constraint_parses, "parse_refusal", parse)
    yield release
    release.set()


def test_a_slow_parse_holds_its_own_request_only_and_runs_out_of_time(slow_parser):
    parses = ConstraintParses(timeout_s=1.0)
    parses.submit(_add("slow", "slow"))
    parses.submit(_add("fast", "[0-9]+"))
    first = _wait_for(parses, 1, timeout_s=0.9)
    assert [v.msg.request_id for v in first] == ["fast"] and first[0].why is None
    assert parses  # the slow one still waits
    late = _wait_for(parses, 1, timeout_s=5.0)
    assert [v.msg.request_id for v in late] == ["slow"]
    assert late[0].why is not None and "took longer than 1 s to parse" in late[0].why
    assert late[0].param is None
    slow_parser.set()  # its answer, when it comes, is for nobody
    time.sleep(0.05)
    assert parses.take() == [] and not parses


def test_an_aborted_request_gets_no_verdict_and_drop_all_names_the_rest(slow_parser):
    parses = ConstraintParses(timeout_s=30.0)
    parses.submit(_add("left", "slow"))
    parses.submit(_add("stays", "slow"))
    assert parses.discard("left") and not parses.discard("left")
    slow_parser.set()
    verdicts = _wait_for(parses, 1)
    assert [v.msg.request_id for v in verdicts] == ["stays"]
    parses.submit(_add("queued", "slow"))
    assert parses.drop_all() == ["queued"] and not parses


def test_a_parser_failure_refuses_that_request_only(monkeypatch):
    def parse(fields, param):
        if fields["regex"] == "boom":
            raise RuntimeError("parser bug")
        return None

    monkeypatch.setattr(constraint_parses, "parse_refusal", parse)
    parses = ConstraintParses(timeout_s=30.0)
    parses.submit(_add("boom", "boom"))
    parses.submit(_add("fine", "x"))
    verdicts = {v.msg.request_id: v for v in _wait_for(parses, 2)}
    assert verdicts["fine"].why is None
    assert verdicts["boom"].param == "regex"
    assert "RuntimeError: parser bug" in (verdicts["boom"].why or "")
