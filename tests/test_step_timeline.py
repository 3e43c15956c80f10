"""The step-timeline recorder on its own: intervals, ordering, the JSON form, the summary
against hand-made records, the `max_records` ring and the no-op paths. No engine."""

from __future__ import annotations

import json
import time

import pytest

from tp_engine.common.step_timeline import (
    NULL_PHASE,
    PhaseRecord,
    StepTimeline,
    gpu_phase_or_null,
    phase_or_null,
    records_from_dict,
    summarize,
)


def _busy(seconds: float = 1e-4) -> None:
    # Spin instead of sleeping: an interval must be measurably positive on any clock.
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_sequential_and_nested_phases_are_ordered_and_positive():
    tl = StepTimeline()
    before = time.perf_counter() - tl._origin
    for step in (0, 1):
        with tl.phase("schedule", step):
            _busy()
        with tl.phase("forward", step):
            _busy()
            with tl.phase("broadcast", step):  # nested: appended before its parent
                _busy()
            _busy()
        with tl.phase("sample", step):
            _busy()
    after = time.perf_counter() - tl._origin
    records = tl.records()
    assert [(r.step_id, r.phase) for r in records] == [
        (s, p) for s in (0, 1) for p in ("schedule", "forward", "broadcast", "sample")
    ]
    assert all(r.duration_s > 0 for r in records)
    assert before <= records[0].start_s and records[-1].end_s <= after
    starts = [r.start_s for r in records]
    assert starts == sorted(starts)
    for step in (0, 1):
        sched, fwd, bcast, sample = [r for r in records if r.step_id == step]
        assert sched.end_s <= fwd.start_s and fwd.end_s <= sample.start_s
        assert fwd.start_s <= bcast.start_s and bcast.end_s <= fwd.end_s
    assert records[3].end_s <= records[4].start_s  # step 0 ends before step 1 starts


def test_a_phase_that_raises_is_recorded_and_the_error_propagates():
    tl = StepTimeline()
    with pytest.raises(RuntimeError, match="boom"), tl.phase("forward", 7):
        raise RuntimeError("boom")
    assert [(r.step_id, r.phase) for r in tl.records()] == [(7, "forward")]


def test_to_dict_round_trips_through_json():
    tl = StepTimeline()
    for step in range(3):
        for name in ("schedule", "build_plan", "forward", "sample"):
            with tl.phase(name, step):
                pass
    d = tl.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["phases"] == ["schedule", "build_plan", "forward", "sample"]
    assert d["num_dropped"] == 0
    assert len(d["records"]) == 12 and d["records"][0][:2] == [0, "schedule"]
    assert records_from_dict(json.loads(json.dumps(d))) == tl.records()


def test_summary_of_hand_made_records():
    tl = StepTimeline()
    # forward starts first, so it is listed first; schedule durations 1, 3 and 2 us.
    tl.record(0, "forward", 0.0, 0.010)
    tl.record(0, "schedule", 0.020, 0.020001)
    tl.record(1, "schedule", 0.030, 0.030003)
    tl.record(2, "schedule", 0.040, 0.040002)
    tl.record(1, "forward", 0.050, 0.080)
    s = tl.summary()
    assert list(s) == ["forward", "schedule"]
    assert s["schedule"]["count"] == 3
    assert s["schedule"]["total_s"] == pytest.approx(6e-6)
    assert s["schedule"]["mean_us"] == pytest.approx(2.0)
    assert s["schedule"]["median_us"] == pytest.approx(2.0)
    assert s["forward"] == pytest.approx(
        {"count": 2, "total_s": 0.040, "mean_us": 20_000.0, "median_us": 20_000.0}
    )
    assert summarize(tl.records()) == s
    assert summarize([]) == {}


def test_record_and_summary_use_the_hand_given_times():
    tl = StepTimeline()
    tl.record(4, "update", 1.5, 1.75)
    assert tl.records() == [PhaseRecord(4, "update", pytest.approx(1.5), pytest.approx(1.75))]
    assert tl.records()[0].duration_s == pytest.approx(0.25)
    with pytest.raises(ValueError, match="ends before it starts"):
        tl.record(4, "update", 2.0, 1.0)


def test_max_records_keeps_the_most_recent():
    tl = StepTimeline(max_records=3)
    for step in range(5):
        tl.record(step, "forward", float(step), step + 0.5)
    assert len(tl) == 3 and tl.num_dropped == 2
    assert [r.step_id for r in tl.records()] == [2, 3, 4]
    assert tl.to_dict()["num_dropped"] == 2
    assert tl.summary()["forward"]["count"] == 3


@pytest.mark.parametrize("bad", [0, -1])
def test_max_records_must_be_positive(bad):
    with pytest.raises(ValueError, match="max_records"):
        StepTimeline(max_records=bad)


def test_phase_or_null_without_a_timeline_records_nothing():
    assert phase_or_null(None, "schedule", 0) is NULL_PHASE
    assert gpu_phase_or_null(None, "forward", 0) is NULL_PHASE
    with phase_or_null(None, "schedule", 0) as value:
        assert value is None
    with pytest.raises(KeyError), phase_or_null(None, "schedule", 0):
        raise KeyError("the no-op does not swallow errors")
    tl = StepTimeline()
    with phase_or_null(tl, "schedule", 3):
        pass
    assert [(r.step_id, r.phase) for r in tl.records()] == [(3, "schedule")]


def test_gpu_phase_is_a_no_op_without_initialised_cuda():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_initialized():
        pytest.skip("CUDA is initialised in this process")
    tl = StepTimeline()
    assert tl.gpu_phase("forward_gpu", 0) is NULL_PHASE
    with tl.gpu_phase("forward_gpu", 0):
        pass
    assert tl.records() == [] and tl.to_dict() == {"phases": [], "records": [], "num_dropped": 0}


@pytest.mark.gpu
def test_gpu_phase_lands_inside_the_host_phase_around_it():
    import torch

    a = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    tl = StepTimeline()
    for step in range(3):
        with tl.phase("forward", step):
            with tl.gpu_phase("forward_gpu", step):
                for _ in range(20):
                    a = a @ a / 2048
            torch.cuda.synchronize()  # the host phase waits for the device work it launched
    records = tl.records()  # resolves the events
    assert sorted((r.step_id, r.phase) for r in records) == [
        (s, p) for s in range(3) for p in ("forward", "forward_gpu")
    ]
    # Host and device clocks are pinned once; allow them 0.5 ms of disagreement.
    for step in range(3):
        host, dev = (
            next(r for r in records if (r.step_id, r.phase) == (step, p))
            for p in ("forward", "forward_gpu")
        )
        assert dev.duration_s > 0
        assert host.start_s - 5e-4 <= dev.start_s and dev.end_s <= host.end_s + 5e-4
    assert set(json.loads(json.dumps(tl.to_dict()))["phases"]) == {"forward", "forward_gpu"}
