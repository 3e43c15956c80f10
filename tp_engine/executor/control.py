"""Rank 0's side of control calls: `EngineControl.call(op, args)` asks every rank, between two
steps, to do something other than a forward pass, and returns what every rank answered.

Ownership: the bring-up gives the engine one `EngineControl` (`LLMEngine.control`) over the
core's few step-ordering operations (`ControlHost`) and the executor that runs the call on every
rank (`tp_engine.executor.base.Executor.control`); the ranks' side, the op table and the
two-phase protocol, is `rank_worker.control.protocol`. A call, on rank 0:

    quiesce       the engine applies the step in flight (asynchronous scheduling), keeping its
                  outputs for the next `step()`: nothing is in flight, so no rank is still
                  computing with what the call may change, and the next plan reads no
                  placeholder tokens of a step before the call
    step id       the next id of the engine's counter: the call sits between the plans before
                  and after it on the plan channel, and errors name it
    execute       the executor publishes the ControlCall on the plan channel (ordered with
                  the plans) and runs rank 0's own part, through its StepExecutor: prepare,
                  gather every rank's verdict, commit only if all said ok, gather every
                  rank's reply
    return        `ControlResult`: ok, the refusals' message, each rank's result

A refusal (any rank's prepare said no, or raised) is a returned value: nothing was changed on
any rank and the engine serves on. A failed commit raises `EngineInconsistentError` and the
engine refuses to step from then on, since the ranks may no longer hold the same model (a
trainer killed in the middle of its broadcasts); the workers keep serving control calls and
still exit cleanly at shutdown. Weight loads are still taken (`REPAIRING_OPS`): one that writes
every weight makes the ranks whole again and the engine serves on. A broken rank (dead,
a collective that failed) is `EngineDeadError`, as for a step.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

from rank_worker.control.protocol import ControlOp, ControlOutcome, ControlResult
from shm_ipc import ControlCall
from tp_engine.common.failures import EngineDeadError
from tp_engine.executor.base import Executor

__all__ = [
    "ControlOp",
    "ControlRefusedError",
    "ControlResult",
    "EngineControl",
    "EngineInconsistentError",
]


class ControlRefusedError(ValueError):
    """A control call some rank refused (a bad weight name or shape, an unknown adapter...):
    nothing changed anywhere and the engine serves on. The message names the rank and why;
    the server answers it with a 400."""


class EngineInconsistentError(EngineDeadError):
    """A control call's commit failed on some rank: the ranks may hold different weights, so
    the engine refuses to step. `result` has every rank's reply."""

    def __init__(self, message: str, result: ControlResult, rank: int | None = None):
        super().__init__(message, rank=rank, step_id=result.step_id)
        self.result = result


class ControlHost(Protocol):
    """What `EngineControl` needs of the engine core (`EngineCore` is one)."""

    def check_usable(self, repairing: bool = False) -> None:
        """Raise the engine's error if it is dead, or inconsistent and the call cannot repair
        it (`repairing`: a weight load, which may make every rank whole again)."""

    def quiesce(self) -> None:
        """Apply the step in flight, if any, keeping its outputs for the next `step()`."""

    def take_step_id(self) -> int:
        """The next step id (plans and calls share the counter)."""

    def failures_named(self, what: str) -> AbstractContextManager[None]:
        """Turn a failure inside into EngineDeadError naming the rank at fault."""

    def mark_inconsistent(self, error: EngineInconsistentError) -> None:
        """From now on every step raises `error`."""


# Calls an inconsistent engine still takes: weight loads (and the trainer's group around them,
# and the question whether a load wrote every weight), since a load that writes every weight
# makes every rank whole again (`weight_updates`).
REPAIRING_OPS = frozenset({
    ControlOp.LOAD_WEIGHTS, ControlOp.LOAD_WEIGHTS_FROM_DISK, ControlOp.LOAD_WEIGHTS_FROM_GROUP,
    ControlOp.INIT_WEIGHTS_UPDATE_GROUP, ControlOp.DESTROY_WEIGHTS_UPDATE_GROUP,
    ControlOp.WEIGHTS_UPDATE_GROUP_STATUS, ControlOp.WEIGHT_CHECKSUMS, ControlOp.WEIGHTS_COVERED,
})  # fmt: skip


class EngineControl:
    """Control calls to every rank (see the module docstring). Not thread-safe: called on the
    engine's thread, between steps."""

    def __init__(self, host: ControlHost, executor: Executor) -> None:
        self.host = host
        self.executor = executor

    def call(self, op: ControlOp, args: Mapping[str, Any] | None = None) -> ControlResult:
        """Run `op` with `args` (msgpack data) on every rank; see the module docstring.

        Raises ValueError for an op this build does not know or args that do not encode
        (nothing is sent then), `EngineInconsistentError` when a commit failed,
        `EngineDeadError` when a rank failed.
        """
        host = self.host
        op = ControlOp(op)  # ValueError for an unknown number, before anything is sent
        args = {} if args is None else dict(args)
        ControlCall(0, int(op), args)  # refuse args that do not encode before quiescing
        host.check_usable(repairing=op in REPAIRING_OPS)
        host.quiesce()
        call = ControlCall(host.take_step_id(), int(op), args)
        with host.failures_named(f"control call {op.name} (step {call.step_id})"):
            result = self.executor.control(call)
        if result.outcome is ControlOutcome.COMMIT_FAILED:
            failed = [reply.rank for reply in result.replies if not reply.ok]
            error = EngineInconsistentError(
                f"control call {op.name} (step {call.step_id}) failed after some ranks may "
                f"have changed their state; the engine refuses to step: {result.message}",
                result,
                rank=failed[0] if len(failed) == 1 else None,
            )
            host.mark_inconsistent(error)
            raise error
        return result
