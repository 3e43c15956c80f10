"""Sleep mode's control ops (SLEEP, WAKE, MEMORY_REPORT) on one rank: checked on every rank in
`prepare`, applied by `rank_worker.runner.device_sleep` in `commit` (see `rank_worker.control.protocol` for the
two phases). Importing this module registers the ops in `rank_worker.control.protocol`'s table.

Arguments (msgpack) and what each rank refuses in prepare, before any rank changes anything:

    op             args                              refused when
    SLEEP          level: 1 | 2                      level unknown; this rank's sleeping tags
                   asleep: {tag: level}              differ from `asleep`, rank 0's view (the
                                                     ranks would no longer hold the same state);
                                                     level 1 and the host has less memory
                                                     available than the weights to copy
    WAKE           tags: [tag, ...] (non-empty)      a tag unknown; `asleep` differs, as above
                   asleep: {tag: level}
    MEMORY_REPORT  (none)                            never

The commits return this rank's `DeviceSleep.report()` under "memory", its "asleep" tags and
"weights_lost": rank 0 checks that every rank agrees and tests read the bytes. Neither commit
issues collectives, except WAKE's graph capture on a GPU, which every rank runs alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rank_worker.control.protocol import (
    _HANDLERS,
    ControlOp,
    ControlRefused,
    OpHandler,
    _check_keys,
)
from rank_worker.runner.device_sleep import SLEEP_LEVELS, DeviceSleep, SleepTag
from rank_worker.tp import TPInfo

if TYPE_CHECKING:
    from rank_worker.runner.model_runner import ModelRunner


def host_memory_available() -> int | None:
    """Bytes the host can still give (MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rank_state(sleep: DeviceSleep) -> dict[str, Any]:
    """What a commit returns: the bytes, the sleeping tags and whether weights were lost."""
    return {
        "memory": sleep.report(),
        "asleep": {tag.value: level for tag, level in sleep.asleep.items()},
        "weights_lost": sleep.weights_lost,
    }


def _check_state(sleep: DeviceSleep, tp: TPInfo, expected: Any) -> None:
    mine = {tag.value: level for tag, level in sleep.asleep.items()}
    if not isinstance(expected, dict) or mine != expected:
        raise ControlRefused(
            f"this rank's sleeping tags {mine} differ from the engine's {expected!r:.200}"
        )


def _prepare_sleep(runner: ModelRunner, tp: TPInfo, args: Mapping[str, Any]) -> int:
    _check_keys(args, {"level", "asleep"})
    level = args.get("level")
    if type(level) is not int or level not in SLEEP_LEVELS:
        raise ControlRefused(f"sleep level must be one of {list(SLEEP_LEVELS)}, got {level!r}")
    sleep = runner.device_sleep
    _check_state(sleep, tp, args.get("asleep"))
    if level == 1 and SleepTag.WEIGHTS not in sleep.asleep:
        need = sleep.device_bytes(SleepTag.WEIGHTS)
        available = host_memory_available()
        if available is not None and need > available:
            raise ControlRefused(
                f"sleep level 1 copies {need} bytes of weights to the host, which has "
                f"{available} available"
            )
    return level


def _commit_sleep(runner: ModelRunner, level: int) -> dict[str, Any]:
    runner.device_sleep.sleep(level)
    return rank_state(runner.device_sleep)


def _prepare_wake(runner: ModelRunner, tp: TPInfo, args: Mapping[str, Any]) -> list[SleepTag]:
    _check_keys(args, {"tags", "asleep"})
    try:
        tags = SleepTag.parse_all(args.get("tags"))
    except ValueError as exc:
        raise ControlRefused(str(exc)) from None
    _check_state(runner.device_sleep, tp, args.get("asleep"))
    return list(tags)


def _commit_wake(runner: ModelRunner, tags: list[SleepTag]) -> dict[str, Any]:
    runner.device_sleep.wake_up(tags)
    return rank_state(runner.device_sleep)


def _prepare_report(runner: ModelRunner, tp: TPInfo, args: Mapping[str, Any]) -> None:
    _check_keys(args, set())


def _commit_report(runner: ModelRunner, prepared: None) -> dict[str, Any]:
    return rank_state(runner.device_sleep)


_HANDLERS.update(
    {
        ControlOp.SLEEP: OpHandler(_prepare_sleep, _commit_sleep),
        ControlOp.WAKE: OpHandler(_prepare_wake, _commit_wake),
        ControlOp.MEMORY_REPORT: OpHandler(_prepare_report, _commit_report),
    }
)
