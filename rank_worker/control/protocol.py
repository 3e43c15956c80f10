"""Control calls on one rank: the op table and the two-phase protocol every rank runs.

Ownership: rank 0 decides to make a call (`tp_engine.executor.control.EngineControl`) and publishes a
`shm_ipc.ControlCall` between two steps; every rank, rank 0 included, runs it here through its
`StepExecutor`, in the order it came on the plan channel. `ControlOp` gives the numbers that
shm_ipc carries a meaning; each op is a pair of functions in `_HANDLERS`.

Every call is two-phase, so that a call one rank refuses changes nothing on any rank:

    state           every rank                                 then
    ─────────────   ────────────────────────────────────────   ──────────────────────────────
    PREPARE         handler.prepare(runner, tp, args):         (ok, message, epoch) of every
                    validate, read, plan the writes; write     rank all-gathered over the TP
                    nothing. A `ControlRefused` or any other   group (`all_gather_bytes`)
                    exception is a refusal naming this rank.
    REFUSED         some rank said no: nobody commits.         result returned on every rank;
                                                               the engine serves on unchanged
    COMMIT          every rank said ok: handler.commit(...)    (ok, message, result, epoch) of
                    does the writes and makes the result.      every rank all-gathered
    COMMITTED       every commit succeeded and every rank's    result returned; rank 0 hands
                    epoch agrees                               every rank's result back
    COMMIT_FAILED   a commit raised (or epochs disagree):      rank 0 marks the engine
                    ranks may now differ                       inconsistent (it refuses to
                                                               step); workers serve on, so
                                                               shutdown stays orderly

Why a commit failure is not a worker exit: every rank still reaches the second gather (the
failure is caught and gathered), so no rank hangs in a collective and rank 0 learns which rank
failed and why. What it cannot know is what the failed commit left half-written, hence the
inconsistent state instead of a refusal. A commit that issues collectives of its own and raises
between them breaks the group anyway; that is a transport failure, fatal as any failed step.

Rules for handlers: `prepare` must not write, and neither phase may issue collectives unless
every rank issues the same ones whatever its verdict (prepare's refusal cannot skip them).
An op whose data arrives from outside whatever the verdict (a trainer's broadcasts) has an
`on_refused` hook: every rank runs it after a REFUSED gather, to consume and drop that data so
the sender never hangs; it writes nothing, and what it raises is logged, not returned.
Arguments and results are msgpack data (maps, lists, str, int, float, bool, bytes, None).

`epoch` counts the calls this rank has committed. Ranks that agree on every verdict agree on it;
a rank whose epoch differs has committed a call another rank did not, which is exactly the
corruption two phases exist to prevent, so a disagreement is reported as COMMIT_FAILED.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from rank_worker.tp import TPInfo, all_gather_bytes
from shm_ipc import ControlCall
from shm_ipc.control_call import (
    RankCommit,
    RankVerdict,
    pack_reply,
    unpack_commit,
    unpack_verdict,
)

if TYPE_CHECKING:
    from rank_worker.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class ControlOp(enum.IntEnum):
    """What a control call asks of every rank (the `op` number on the wire)."""

    # Each rank returns {parameter name: xxh3_64 of its shard's bytes}: shows which ranks hold
    # which weights, and (after an update) that every rank applied the same one.
    WEIGHT_CHECKSUMS = 1
    # Refused by any rank that has no parameter of one of `names` (validation only, the first
    # half of a weight update). `ranks` (optional) limits the check to those ranks, so that a
    # test or an operator can make one chosen rank refuse.
    CHECK_NAMES = 2
    # 10-19: weight updates (`rank_worker.control.weight_ops`, which documents their arguments).
    LOAD_WEIGHTS = 10  # full tensors from rank 0, broadcast over the TP group in buckets
    LOAD_WEIGHTS_FROM_DISK = 11  # each rank reads a safetensors checkpoint itself
    # 12, 14, 16: a trainer's group (`rank_worker.control.weight_group`): start joining it in the
    # background, leave it (or abandon the join), and each rank's join state.
    INIT_WEIGHTS_UPDATE_GROUP = 12
    LOAD_WEIGHTS_FROM_GROUP = 13  # tensors broadcast by the trainer on that group
    DESTROY_WEIGHTS_UPDATE_GROUP = 14
    GET_WEIGHTS_BY_NAME = 15  # the first values of one checkpoint tensor, from every rank
    WEIGHTS_UPDATE_GROUP_STATUS = 16
    # Whether the checkpoint names given fill every part this rank's stage must hold: after a
    # level-2 sleep, the engine serves again only once every rank says yes (under pipeline
    # parallelism rank 0's map knows its own stage's parts only).
    WEIGHTS_COVERED = 17
    # Sleep mode (`rank_worker.control.sleep_ops`, which registers them in `_HANDLERS`; step.py
    # imports it): release the weights' and the KV cache's device memory, restore it, and
    # report each rank's bytes.
    SLEEP = 20
    WAKE = 21
    MEMORY_REPORT = 22
    # Multi-LoRA (`rank_worker.control.lora_ops`, registered like sleep's): put an adapter into a
    # device slot, empty a slot.
    LOAD_LORA = 30
    UNLOAD_LORA = 31


class ControlOutcome(enum.Enum):
    """How a call ended; the same on every rank (see the module docstring's states)."""

    COMMITTED = "committed"
    REFUSED = "refused"
    COMMIT_FAILED = "commit_failed"


class ControlRefused(Exception):
    """Raised by an op's `prepare` to refuse with a plain message (no exception type in it)."""


@dataclass(frozen=True)
class RankReply:
    """One rank's part of a call, as every rank learns it from the gathers."""

    rank: int
    ok: bool  # prepare's verdict, or (after COMMIT) whether the commit succeeded
    message: str  # why not, naming the rank and the op; "" when ok
    result: Any  # the commit's value (msgpack data); None unless this rank committed
    epoch: int  # calls this rank had committed when it replied


@dataclass(frozen=True)
class ControlResult:
    """The call's verdict and every rank's reply, in rank order; the same on every rank."""

    op: int  # a ControlOp number (an unknown one when some rank refused it as unknown)
    step_id: int
    outcome: ControlOutcome
    message: str  # "" when committed; else every failing rank's message, joined by "; "
    replies: tuple[RankReply, ...]

    @property
    def ok(self) -> bool:
        return self.outcome is ControlOutcome.COMMITTED

    @property
    def results(self) -> list[Any]:
        """Each rank's commit result, rank order (all None when refused)."""
        return [reply.result for reply in self.replies]


@dataclass(frozen=True)
class OpHandler:
    """The two halves of one op; see the module docstring's rules."""

    # (runner, tp, args) -> what commit needs; raises to refuse.
    prepare: Callable[[ModelRunner, TPInfo, Mapping[str, Any]], Any]
    # (runner, prepared) -> the result (msgpack data).
    commit: Callable[[ModelRunner, Any], Any]
    # (runner, tp, args), run on every rank when the call was refused (by any rank), after the
    # verdicts are gathered: for an op whose data arrives from outside whatever the verdict (a
    # trainer's broadcasts), to consume and drop it so that the sender never hangs. It may
    # issue collectives on groups other than the TP group (every rank runs it); what it
    # raises is logged, the call stays refused.
    on_refused: Callable[[ModelRunner, TPInfo, Mapping[str, Any]], None] | None = None


def _op_name(op: int) -> str:
    try:
        return ControlOp(op).name
    except ValueError:
        return f"op {op}"


class RankControl:
    """Runs control calls on this rank's `ModelRunner` (see the module docstring).

    Owned by the rank's `StepExecutor`; `epoch` is the only state it keeps."""

    def __init__(self, runner: ModelRunner, tp: TPInfo) -> None:
        self.runner = runner
        self.tp = tp
        self.epoch = 0

    def run(self, call: ControlCall) -> ControlResult:
        """Both phases of `call`; every rank must run it (it issues two collectives at most)."""
        rank, name = self.tp.rank, _op_name(call.op)
        handler = _HANDLERS.get(call.op)
        prepared: Any = None
        try:
            if handler is None:
                raise ControlRefused(f"unknown control op {call.op}")
            prepared = handler.prepare(self.runner, self.tp, call.args)
            verdict = RankVerdict(True, "", self.epoch)
        except Exception as exc:
            verdict = RankVerdict(False, _why(rank, "refused", name, exc), self.epoch)
        # Nobody writes before every verdict is in: this gather is the protocol's one barrier.
        verdicts = [unpack_verdict(raw) for raw in all_gather_bytes(pack_reply(verdict), self.tp)]
        if not all(v.ok for v in verdicts):
            if handler is not None and handler.on_refused is not None:
                try:
                    handler.on_refused(self.runner, self.tp, call.args)
                except Exception:
                    logger.exception("rank %d: %s's on_refused hook failed", rank, name)
            replies = tuple(
                RankReply(r, v.ok, v.message, None, v.epoch) for r, v in enumerate(verdicts)
            )
            return self._result(call, ControlOutcome.REFUSED, replies)
        assert handler is not None  # every rank, this one included, accepted the op
        try:
            result = handler.commit(self.runner, prepared)
            # A result that does not encode fails this rank's commit.
            packed = pack_reply(RankCommit(True, "", result, self.epoch + 1))
            self.epoch += 1
        except Exception as exc:
            why = _why(rank, "failed to commit", name, exc)
            packed = pack_reply(RankCommit(False, why, None, self.epoch))
        gathered = [unpack_commit(raw) for raw in all_gather_bytes(packed, self.tp)]
        replies = tuple(
            RankReply(r, g.ok, g.message, g.result, g.epoch) for r, g in enumerate(gathered)
        )
        epochs = {reply.epoch for reply in replies}
        if all(reply.ok for reply in replies) and len(epochs) == 1:
            return self._result(call, ControlOutcome.COMMITTED, replies)
        if all(reply.ok for reply in replies):
            # Every commit succeeded, yet some rank has committed a call another did not.
            message = f"{name}: the ranks' control epochs differ: {[r.epoch for r in replies]}"
            return ControlResult(
                call.op, call.step_id, ControlOutcome.COMMIT_FAILED, message, replies
            )
        return self._result(call, ControlOutcome.COMMIT_FAILED, replies)

    @staticmethod
    def _result(
        call: ControlCall, outcome: ControlOutcome, replies: tuple[RankReply, ...]
    ) -> ControlResult:
        message = "; ".join(reply.message for reply in replies if not reply.ok)
        return ControlResult(call.op, call.step_id, outcome, message, replies)


def _why(rank: int, did: str, op_name: str, exc: Exception) -> str:
    reason = str(exc) if isinstance(exc, ControlRefused) else f"{type(exc).__name__}: {exc}"
    return f"rank {rank} {did} {op_name}: {reason}"


def _check_keys(args: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(args) - allowed)
    if unknown:
        raise ControlRefused(f"unknown arguments {unknown} (takes {sorted(allowed)})")


# -- ops -----------------------------------------------------------------------------------------


def local_parameters(runner: ModelRunner) -> dict[str, torch.Tensor]:
    """This rank's parameters by name: the model's, and the draft model's under "draft."."""
    params = dict(runner.model.named_parameters())
    if runner.draft is not None:
        params.update({f"draft.{n}": p for n, p in runner.draft.model.named_parameters()})
    return params


def parameter_checksum(tensor: torch.Tensor) -> int:
    """xxh3_64 of the tensor's bytes: any changed element (or dtype, through its bytes)
    changes it, where a sum would miss a permutation."""
    host = tensor.detach().contiguous().cpu()
    return xxhash.xxh3_64_intdigest(host.view(torch.uint8).numpy())


def _prepare_checksums(runner: ModelRunner, tp: TPInfo, args: Mapping[str, Any]) -> None:
    _check_keys(args, set())


def _commit_checksums(runner: ModelRunner, prepared: None) -> dict[str, int]:
    return {name: parameter_checksum(p) for name, p in local_parameters(runner).items()}


def _prepare_check_names(runner: ModelRunner, tp: TPInfo, args: Mapping[str, Any]) -> int:
    _check_keys(args, {"names", "ranks"})
    names, ranks = args.get("names"), args.get("ranks")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ControlRefused(f"names must be a list of str, got {names!r:.200}")
    if ranks is not None and (
        not isinstance(ranks, list) or not all(type(r) is int for r in ranks)
    ):
        raise ControlRefused(f"ranks must be a list of int, got {ranks!r:.200}")
    if ranks is not None and tp.rank not in ranks:
        return 0
    known = local_parameters(runner)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ControlRefused(f"unknown parameter names {unknown[:5]}")
    return len(names)


def _commit_check_names(runner: ModelRunner, checked: int) -> int:
    return checked  # how many names this rank checked


_HANDLERS: dict[int, OpHandler] = {
    ControlOp.WEIGHT_CHECKSUMS: OpHandler(_prepare_checksums, _commit_checksums),
    ControlOp.CHECK_NAMES: OpHandler(_prepare_check_names, _commit_check_names),
}
