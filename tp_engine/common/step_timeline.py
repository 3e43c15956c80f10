"""Where rank 0's engine spends each step: named intervals on rank 0's wall clock.

Owner: rank 0 only. `LLMEngine.step` wraps its phases (schedule, build_plan, broadcast,
forward, sample, update, ...) in `phase_or_null(self.timeline, name, step_id)`; with no timeline
attached that is one shared no-op object, so the hook costs an attribute read and a call.
`launch/bench.py --step-timeline` attaches a `StepTimeline` for the timed run and writes
`to_dict()`; `launch/plot.py timeline` draws it.

Clock: `time.perf_counter()` in seconds, relative to the timeline's creation. A record is
`(step_id, phase, start_s, end_s)`, appended when its block exits (also when the block raises:
the time was spent), so a phase nested in another is appended before it; `records()` returns
them sorted by start (outer before inner on ties).

Two kinds of phase:

- `phase(name, step_id)`: host time of the block. On CPU this is the real work; on GPU it is
  what rank 0's Python thread spent, which for an asynchronous forward is the launch time.
- `gpu_phase(name, step_id)`: device time of the block, from two CUDA events on the current
  stream, used only when torch is imported and CUDA is initialised; otherwise (CPU runs) it
  records nothing, because the host phases around it already measure the real work. The events
  are resolved lazily, in `records()` (which synchronises): each is placed on the wall clock by
  its `elapsed_time` from a reference event recorded right after a `torch.cuda.synchronize()`
  at the first `gpu_phase`, together with a `perf_counter()` reading. Drift between the two
  clocks over a run is not corrected. Give a device phase its own name (e.g. "forward_gpu")
  when the host phase around the same code is also recorded, or the two land in one lane.

Memory: `max_records` keeps the most recent records (a ring): the oldest are dropped, and
`num_dropped` counts them, so a long serving run keeps its latest steps; a step at the edge of
the window may have lost its first phases. Unpending a device record needs its events alive,
so they count against the same cap.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# One held interval: (step_id, phase, start, end). Host phases hold raw perf_counter() floats;
# device phases hold two pending torch.cuda.Event objects until `records()` resolves them.
_Entry = tuple[int, str, Any, Any]


@dataclass(frozen=True)
class PhaseRecord:
    """One interval of one step, in seconds since the timeline was created."""

    step_id: int  # the engine's step id (StepPlan.step_id of that step)
    phase: str  # "schedule", "build_plan", "broadcast", "forward", "sample", "update", ...
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


class _NullPhase:
    """The context manager of a phase nobody records; one shared instance, no state."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        return None


NULL_PHASE = _NullPhase()


class _HostPhase:
    __slots__ = ("_name", "_start", "_step_id", "_timeline")

    def __init__(self, timeline: StepTimeline, name: str, step_id: int) -> None:
        self._timeline = timeline
        self._name = name
        self._step_id = step_id
        self._start = 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc_info: object) -> None:
        end = time.perf_counter()
        self._timeline._append((self._step_id, self._name, self._start, end))


class _GpuPhase:
    __slots__ = ("_cuda", "_name", "_start", "_step_id", "_timeline")

    def __init__(self, timeline: StepTimeline, cuda: Any, name: str, step_id: int) -> None:
        self._timeline = timeline
        self._cuda = cuda
        self._name = name
        self._step_id = step_id
        self._start: Any = None

    def __enter__(self) -> None:
        self._start = self._cuda.Event(enable_timing=True)
        self._start.record()

    def __exit__(self, *exc_info: object) -> None:
        end = self._cuda.Event(enable_timing=True)
        end.record()
        self._timeline._append((self._step_id, self._name, self._start, end))
        self._timeline._num_pending += 1


class StepTimeline:
    """Records `(step_id, phase, start_s, end_s)` intervals of rank 0's engine steps."""

    def __init__(self, max_records: int | None = None) -> None:
        if max_records is not None and max_records < 1:
            raise ValueError(f"max_records must be a positive number or None, got {max_records}")
        self.max_records = max_records
        self._origin = time.perf_counter()
        self._entries: deque[_Entry] = deque(maxlen=max_records)
        self._num_appended = 0
        self._num_pending = 0  # device entries not yet resolved (an upper bound after drops)
        # (reference event, its perf_counter reading), set at the first device phase.
        self._cuda_ref: tuple[Any, float] | None = None

    # -- recording (hot path) --------------------------------------------------------------------

    def phase(self, name: str, step_id: int) -> _HostPhase:
        """`with timeline.phase("schedule", step_id):` records the block's host time."""
        return _HostPhase(self, name, step_id)

    def gpu_phase(self, name: str, step_id: int) -> _GpuPhase | _NullPhase:
        """`with timeline.gpu_phase("forward_gpu", step_id):` records the block's device time
        on the current CUDA stream; a no-op (records nothing) unless CUDA is initialised."""
        cuda = _initialised_cuda()
        if cuda is None:
            return NULL_PHASE
        if self._cuda_ref is None:
            # Idle stream: the reference event's GPU timestamp is taken right after the
            # perf_counter reading, which pins the device clock to the host clock.
            cuda.synchronize()
            ref = cuda.Event(enable_timing=True)
            wall = time.perf_counter()
            ref.record()
            self._cuda_ref = (ref, wall)
        return _GpuPhase(self, cuda, name, step_id)

    def record(self, step_id: int, phase: str, start_s: float, end_s: float) -> None:
        """Add an interval measured elsewhere, in seconds since this timeline's creation."""
        if end_s < start_s:
            raise ValueError(f"phase {phase!r} of step {step_id} ends before it starts")
        self._append((step_id, phase, self._origin + start_s, self._origin + end_s))

    def _append(self, entry: _Entry) -> None:
        self._entries.append(entry)  # a full deque drops its oldest entry
        self._num_appended += 1

    # -- reading (after the run) ------------------------------------------------------------------

    @property
    def num_dropped(self) -> int:
        """Records dropped because of `max_records`."""
        return self._num_appended - len(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def records(self) -> list[PhaseRecord]:
        """Every held record, sorted by start time; resolves device phases (synchronises)."""
        if self._num_pending:
            self._resolve_gpu()
        origin = self._origin
        out = [
            PhaseRecord(step_id, phase, start - origin, end - origin)
            for step_id, phase, start, end in self._entries
        ]
        out.sort(key=lambda r: (r.start_s, -r.end_s))
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: phase names in order of first appearance, records as lists."""
        records = self.records()
        return {
            "phases": _phase_order(records),
            "records": [[r.step_id, r.phase, r.start_s, r.end_s] for r in records],
            "num_dropped": self.num_dropped,
        }

    def summary(self) -> dict[str, dict[str, float]]:
        """Per phase: count, total_s, mean_us, median_us (see `summarize`)."""
        return summarize(self.records())

    def _resolve_gpu(self) -> None:
        cuda = sys.modules["torch"].cuda
        cuda.synchronize()
        assert self._cuda_ref is not None  # a device entry exists only after one was set
        ref, ref_wall = self._cuda_ref
        resolved: list[_Entry] = []
        for step_id, phase, start, end in self._entries:
            if not isinstance(start, float):
                # elapsed_time is in milliseconds, from the reference event to this one.
                start = ref_wall + ref.elapsed_time(start) / 1e3
                end = ref_wall + ref.elapsed_time(end) / 1e3
            resolved.append((step_id, phase, start, end))
        self._entries = deque(resolved, maxlen=self.max_records)
        self._num_pending = 0


def phase_or_null(
    timeline: StepTimeline | None, name: str, step_id: int
) -> _HostPhase | _NullPhase:
    """`timeline.phase(name, step_id)`, or the shared no-op `NULL_PHASE` without a timeline."""
    return NULL_PHASE if timeline is None else timeline.phase(name, step_id)


def gpu_phase_or_null(
    timeline: StepTimeline | None, name: str, step_id: int
) -> _GpuPhase | _NullPhase:
    """`timeline.gpu_phase(name, step_id)`, or the shared no-op `NULL_PHASE`."""
    return NULL_PHASE if timeline is None else timeline.gpu_phase(name, step_id)


def summarize(records: Iterable[PhaseRecord]) -> dict[str, dict[str, float]]:
    """Per phase, in order of first appearance: `count`, `total_s`, `mean_us`, `median_us`."""
    records = list(records)
    durations: dict[str, list[float]] = {name: [] for name in _phase_order(records)}
    for r in records:
        durations[r.phase].append(r.duration_s)
    return {
        name: {
            "count": len(ds),
            "total_s": sum(ds),
            "mean_us": sum(ds) / len(ds) * 1e6,
            "median_us": statistics.median(ds) * 1e6,
        }
        for name, ds in durations.items()
    }


def records_from_dict(data: dict[str, Any]) -> list[PhaseRecord]:
    """The records of a `to_dict()` (e.g. read back from a result file)."""
    return [PhaseRecord(int(s), str(p), float(a), float(b)) for s, p, a, b in data["records"]]


def _phase_order(records: Iterable[PhaseRecord]) -> list[str]:
    return list(dict.fromkeys(r.phase for r in records))


def _initialised_cuda() -> Any:
    """`torch.cuda` if torch is imported and CUDA initialised in this process, else None.

    Looks in sys.modules so that this module never imports torch (or initialises CUDA) itself.
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return torch.cuda
