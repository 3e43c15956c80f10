"""Rank 0's serving loop: requests in over ZeroMQ, one engine step at a time, token deltas out.

Ownership: this loop is the only user of the `LLMEngine` (one thread; the engine is not
thread-safe). Per iteration:

    poll the inbox → apply every Add / Abort (verdicts sent at once: the API process sets up
    each response while the step runs) → step once → send one EngineOutputs if anything changed

An Add with pooling params runs as `PoolingParams` (its one Delta carries the pooled vector as
little-endian float32 bytes); one with bootstrap fields takes the server's prefill/decode role.

States and what ends them:

    SERVING ──Control pause──► PAUSED (requests queue; "wait" lets the running ones finish)
       │    ◄──Control resume──┘        asleep, too, is PAUSED to this loop (`engine.has_work`)
    SERVING ──SIGINT/SIGTERM──► DRAINING ──no work left, or deadline──► EXIT (code 0)
       │                           │          (at the deadline the rest are aborted)
       ├──EngineDeadError / watchdog──► DEAD: Dead sent, linger, Exit → code 1
       ├──end_now (the launcher is gone)──► DEAD without the linger → code 1
       └──the API process died─────► code 1

A hung step never returns to the loop, so `Watchdog` (a thread) watches it: when no step has
completed for `iteration_timeout_s` while work it could do is queued, `_on_stall` tells the API
process the engine is dead (health turns 503), waits the linger, and ends the process through
`on_fatal` (the other ranks notice rank 0 is gone and exit by themselves). A paused or sleeping
engine has queued requests but nothing it may do, and a control call (a weight update that waits
for a trainer's broadcast) is not a step: neither counts as a stall.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np

from tp_engine.core.engine_states import PauseMode
from tp_engine.core.outputs import SequenceOutput
from tp_engine.core.sequence import SequenceStatus
from tp_engine.engine import EngineDeadError, LLMEngine
from tp_engine.features.weights_and_sleep.sleep import WeightsNotLoadedError
from tp_engine.pooling_params import PoolingParams
from tp_engine.sampling_params import SamplingParams
from tp_engine.server.args import LoopOptions
from tp_engine.server.ipc import EnginePipes
from tp_engine.server.messages import (
    AbortRequest,
    AddRequest,
    Control,
    ControlReply,
    Dead,
    Delta,
    Drain,
    EngineOutputs,
    EngineStats,
    Exit,
    Rejected,
)
from tp_engine.server.rank0.constraint_parses import ConstraintParses
from tp_engine.server.rank0.control_ops import run_op
from tp_engine.server.rank0.disagg.serving import NoRole
from tp_engine.server.rank0.watchdog import Watchdog, park, stop_api_process
from tp_engine.server.request_trace import for_process

logger = logging.getLogger(__name__)

# How long an idle loop sleeps in poll: bounds how late a signal or a dead API is noticed.
_IDLE_POLL_S = 0.05
# How often an idle loop asks whether every rank is still there (`Executor.check_ranks`): a
# rank or a node lost while no step runs would otherwise be found by the next request.
_RANK_CHECK_S = 0.5
# ...and while constraints parse: how late a parsed request is added.
_PARSE_POLL_S = 0.002

EXIT_OK = 0
EXIT_FAILED = 1


@dataclass(frozen=True)
class _Live:
    """One sample (engine sequence) of an accepted request that has not finished."""

    seq_id: str  # the engine's id of the sequence
    request_id: str  # the API's id; the sequence's own id differs when n > 1
    index: int  # which of the request's samples


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        pipes: EnginePipes,
        api_proc: subprocess.Popen,
        options: LoopOptions,
        on_fatal: Callable[[int], None],
        disaggregation: NoRole | None = None,
    ) -> None:
        self.engine = engine
        # This server's role behind a prefill/decode router (`disagg`), or none.
        self._pd = disaggregation or NoRole()
        self.pipes = pipes
        self.api_proc = api_proc
        self.options = options
        self._on_fatal = on_fatal
        self._live: dict[str, _Live] = {}  # by sequence id
        self._requests: dict[str, list[_Live]] = {}  # the API's request id -> its samples
        self._accepted: list[str] = []
        self._rejected: list[Rejected] = []
        # Requests whose output constraint is compiling, by their first sequence's id: accepted
        # once it compiles, rejected (400) if it fails or runs out of time.
        self._compiling: dict[str, str] = {}
        engine.compile_verdicts = {}
        # Requests whose output constraints parse on a thread of their own (the API process
        # cannot parse them): added to the engine, or refused, once parsed.
        self._parses = ConstraintParses(engine.config.structured_outputs_timeout_s)
        self._deltas: list[Delta] = []
        self._last_stats: EngineStats | None = None
        self._stop_signal: int | None = None
        self._drain_deadline: float | None = None
        self._end_reason: str | None = None
        # Calls of `pause` in "wait" mode, answered once no running request is left.
        self._pending_pauses: list[int] = []
        self._watchdog = Watchdog(options.iteration_timeout_s, self._on_stall)
        # Per-request timestamps for the TTFT breakdown; None unless asked for (request_trace).
        self._trace = for_process("rank0")
        self._num_steps = 0
        self._next_rank_check = 0.0

    def request_stop(self, signum: int) -> None:
        """From a signal handler: begin a graceful shutdown at the next iteration."""
        if self._stop_signal is None:
            self._stop_signal = signum

    def end_now(self, reason: str) -> None:
        """From another thread: at the next iteration, fail every request with `reason` and
        exit 1, as a dead engine does but without the linger: nothing will serve this run
        again (its launcher is gone), so the processes should go as soon as they can."""
        self._end_reason = reason

    # -- the loop ----------------------------------------------------------------------------------

    def run(self) -> int:
        """Serve until shut down; returns the process exit code."""
        self._watchdog.start()
        try:
            return self._serve()
        finally:
            self._watchdog.stop()

    def _serve(self) -> int:
        engine = self.engine
        while True:
            if self._watchdog.fired.is_set():
                park()  # the watchdog has taken over and ends the process
            if self._end_reason is not None:
                return self._die(self._end_reason, linger_s=0.0)
            busy = engine.has_work()
            self._watchdog.busy(busy)
            if self._parses:
                self._take_parses()
            waits = self._take_pd() or bool(self._parses)
            idle_poll_s = _PARSE_POLL_S if waits else _IDLE_POLL_S
            if self.pipes.poll(0 if busy else idle_poll_s):
                try:
                    self._read_inbox()
                except Exception as exc:  # a malformed frame or a bug: fail loudly, never hang
                    logger.exception("engine loop: reading the API's messages failed")
                    return self._die(f"rank 0 failed: {type(exc).__name__}: {exc}")
                if self._accepted or self._rejected:  # the verdicts now: see the docstring
                    self._flush()
            if self._stop_signal is not None and self._drain_deadline is None:
                self._begin_drain()
            if self.api_proc.poll() is not None:
                logger.error(
                    "the API process exited (code %s); shutting down", self.api_proc.returncode
                )
                return EXIT_FAILED
            # Draining is done when nothing can run any more (every request finished, or the
            # rest held by a pause or sleep) or at the deadline; what is left is aborted.
            if self._drain_deadline is not None and (
                not (engine.has_work() or self._parses) or time.monotonic() > self._drain_deadline
            ):
                if engine.has_unfinished() or self._parses:
                    self._abort_everything()
                self._flush()
                return self._finish(EXIT_OK)
            if engine.has_work():
                try:
                    self._step()
                except EngineDeadError as exc:
                    return self._die(str(exc))
                except Exception as exc:  # a bug on rank 0: fail every request, not just hang
                    logger.exception("engine step failed")
                    return self._die(f"rank 0 failed: {type(exc).__name__}: {exc}")
            elif time.monotonic() >= self._next_rank_check:
                self._next_rank_check = time.monotonic() + _RANK_CHECK_S
                lost = engine.executor.check_ranks()
                if lost is not None:
                    return self._die(str(lost))
            self._flush()
            if self._pending_pauses and not engine.has_work():
                self._answer_pauses()

    def _read_inbox(self) -> None:
        while (msg := self.pipes.recv_nowait()) is not None:
            if isinstance(msg, AddRequest):
                self._add(msg)
            elif isinstance(msg, AbortRequest):
                self._abort(msg)
            elif isinstance(msg, Control):
                self._control(msg)
            else:
                logger.warning("engine loop: ignoring unexpected %s", type(msg).__name__)

    def _add(self, msg: AddRequest) -> None:
        if self._trace is not None:
            self._trace.mark("r0_add", msg.request_id)
        if self._drain_deadline is not None:
            self._rejected.append(
                Rejected(msg.request_id, 503, "the server is shutting down; retry elsewhere")
            )
            return
        if self.engine.inconsistent is not None:
            why = f"the engine's weights are inconsistent until a full update: {self.engine.inconsistent}"
            self._rejected.append(Rejected(msg.request_id, 503, why))
            return
        lora = msg.lora_request
        if lora is not None and lora.lora_int_id not in self.engine.list_loras():
            # Unloaded after the API process picked it (vLLM's answer to an unknown model).
            self._rejected.append(
                Rejected(msg.request_id, 404, f"The model `{lora.lora_name}` does not exist.")
            )
            return
        if msg.constraint_checks:
            self._parses.submit(msg)  # added by `_take_parses` once its constraints parse
            return
        self._admit(msg)

    def _take_parses(self) -> None:
        for verdict in self._parses.take():
            if verdict.why is None:
                self._admit(verdict.msg)
            else:
                self._rejected.append(
                    Rejected(verdict.msg.request_id, 400, verdict.why, verdict.param)
                )

    def _admit(self, msg: AddRequest) -> None:
        lora = msg.lora_request
        try:
            # In the server's prefill/decode role, if it has one (`disagg`).
            seq_ids = self._pd.add(self.engine, msg, _params(msg), lora)
        except (ValueError, TypeError) as exc:
            # The engine refuses what it cannot serve (too long, unsupported field): that
            # request gets a 400, everything else keeps running.
            self._rejected.append(Rejected(msg.request_id, 400, str(exc)))
            return
        except WeightsNotLoadedError as exc:  # after sleep(level=2), until new weights
            self._rejected.append(Rejected(msg.request_id, 503, str(exc)))
            return
        samples = [_Live(seq_id, msg.request_id, i) for i, seq_id in enumerate(seq_ids)]
        self._requests[msg.request_id] = samples
        for live in samples:
            self._live[live.seq_id] = live
        if self.engine.is_compiling(seq_ids[0]):
            self._compiling[seq_ids[0]] = msg.request_id
        else:
            self._accepted.append(msg.request_id)

    def _abort(self, msg: AbortRequest) -> None:
        if self._parses.discard(msg.request_id):
            return  # the client left while its constraint parsed: nothing was added
        samples = self._requests.get(msg.request_id, [])
        if samples and samples[0].seq_id in self._compiling:  # the client left while it compiled
            del self._compiling[samples[0].seq_id]
        for index, live in enumerate(samples):
            if msg.sample_indices is not None and index not in msg.sample_indices:
                continue
            if self._live.pop(live.seq_id, None) is None:
                continue  # finished already
            if msg.stopped:  # a stop string the API process found
                self.engine.finish_request(live.seq_id, SequenceStatus.FINISHED_STOPPED)
            else:
                self.engine.abort_request(live.seq_id)
            self._pd.aborted(live.seq_id)
        self._forget_if_done(msg.request_id)

    def _control(self, msg: Control) -> None:
        """Run an admin operation between two steps and answer it (`control_ops`). While it
        runs the watchdog stands down: a weight update waiting for a trainer's broadcast is
        not a hung step. An EngineDeadError goes up to the loop, as a step's does."""
        if msg.op == "pause":
            self._pause(msg)
            return
        self._watchdog.busy(False)
        outcome = run_op(self.engine, msg.op, msg.args)
        self._watchdog.progress()
        if msg.op == "resume":
            self._answer_pauses()  # a "wait" pause that never drained is over too
        if msg.op == "sleep" and outcome.status == 200:
            # Sleep ended every unfinished request (their K/V is gone): tell their clients.
            self._abort_everything("the engine went to sleep")
        self._flush()  # outputs the operation made (the step it quiesced) go first
        self.pipes.send(ControlReply(msg.call_id, outcome.status, outcome.message, outcome.result))

    def _pause(self, msg: Control) -> None:
        try:
            mode = PauseMode.parse(str(msg.args.get("mode", "abort")))
        except ValueError as exc:
            self.pipes.send(ControlReply(msg.call_id, 400, str(exc), {}))
            return
        self.engine.pause(mode)
        if mode is PauseMode.ABORT:
            # The engine has ended them; their clients get the output so far, as "abort".
            self._abort_everything("generation was paused (mode abort)")
        self._flush()
        if self.engine.has_work():
            self._pending_pauses.append(msg.call_id)
        else:
            self.pipes.send(ControlReply(msg.call_id, 200, "", {}))

    def _answer_pauses(self) -> None:
        for call_id in self._pending_pauses:
            self.pipes.send(ControlReply(call_id, 200, "", {}))
        self._pending_pauses.clear()

    def _forget_if_done(self, request_id: str) -> None:
        samples = self._requests.get(request_id, [])
        if all(live.seq_id not in self._live for live in samples):
            self._requests.pop(request_id, None)

    def _step(self) -> None:
        start = time.monotonic()
        step = self.engine.step()
        self._num_steps += 1
        if self._trace is not None:
            self._trace_step(start, step.outputs)
        if step.made_progress:
            self._watchdog.progress()
        self._take_compile_verdicts()
        for out in step.outputs:
            # A prefill's answer is sent once its pages are written (`_take_pd`).
            if not self._pd.holds(out):
                self._emit(out)

    def _emit(self, out: SequenceOutput, error: str | None = None) -> None:
        """Send a sample's news (`error`: it failed on its own, a 500 saying why)."""
        live = self._live.get(out.seq_id)
        if live is None:
            return  # aborted, or stopped by the API process meanwhile
        if out.finished:
            del self._live[out.seq_id]
            self._forget_if_done(live.request_id)
        delta = _delta(live.request_id, out)
        self._deltas.append(delta if error is None else msgspec.structs.replace(delta, error=error))

    def _take_pd(self) -> bool:
        """Send what the server's role released (first tokens, answers, failures); busy?"""
        released = self._pd.poll()
        for out, error in released:
            self._emit(out, error)
        if released:
            self._flush()  # now, not after the next step: a router waits on a prefill's answer
        return self._pd.busy

    def _take_compile_verdicts(self) -> None:
        """Accept the requests whose constraint compiled; reject (400) the others, whose
        sequences the engine has ended (their outputs are not sent: a rejection is final)."""
        verdicts = self.engine.compile_verdicts
        if not verdicts:
            return
        for first_id, why in verdicts.items():
            request_id = self._compiling.pop(first_id, None)
            if request_id is None:
                continue  # aborted while it compiled
            if why is None:
                self._accepted.append(request_id)
                continue
            self._rejected.append(Rejected(request_id, 400, f"request {request_id!r}: {why}"))
            for live in self._requests.pop(request_id, []):
                self._live.pop(live.seq_id, None)
        verdicts.clear()

    def _flush(self) -> None:
        stats = self.engine.stats()
        if not (self._accepted or self._rejected or self._deltas) and stats == self._last_stats:
            return
        if self._trace is not None:  # before the send: the API process may read it at once
            for delta in self._deltas:
                self._trace.mark_once("r0_sent", delta.request_id)
        self.pipes.send(EngineOutputs(self._accepted, self._rejected, self._deltas, stats))
        self._accepted, self._rejected, self._deltas = [], [], []
        self._last_stats = stats

    def _trace_step(self, start: float, outputs: list[SequenceOutput]) -> None:
        trace = self._trace
        assert trace is not None
        end = time.monotonic()
        trace.mark("step", "", t=end, start=start, end=end, outputs=len(outputs),
                   step=self._num_steps)  # fmt: skip
        for out in outputs:
            live = self._live.get(out.seq_id)
            if live is not None and out.new_token_ids:
                trace.mark_once(
                    "r0_first_out", live.request_id, t=end, queue_time_s=out.queue_time_s,
                    step=self._num_steps,
                )  # fmt: skip

    # -- endings -----------------------------------------------------------------------------------

    def _begin_drain(self) -> None:
        timeout = self.options.shutdown_timeout_s
        logger.info(
            "signal %s: no new requests; %d in flight get %.0f s to finish",
            self._stop_signal,
            len(self._live),
            timeout,
        )
        self._drain_deadline = time.monotonic() + timeout
        self.pipes.send(Drain(timeout))

    def _abort_everything(self, why: str = "the server is shutting down; retry elsewhere") -> None:
        logger.warning("%s: aborting %d sequences", why, len(self._live))
        for request_id in self._parses.drop_all():  # never added
            self._rejected.append(Rejected(request_id, 503, why))
        for request_id in self._compiling.values():  # never accepted
            self._rejected.append(Rejected(request_id, 503, why))
            for live in self._requests.pop(request_id, []):
                self.engine.abort_request(live.seq_id)
                self._live.pop(live.seq_id, None)
        self._compiling.clear()
        for seq_id, live in list(self._live.items()):
            self.engine.abort_request(seq_id)
            self._deltas.append(
                Delta(live.request_id, live.index, [], "abort", None, None, None, None, None)
            )
        self._live.clear()
        self._requests.clear()

    def _die(self, message: str, linger_s: float | None = None) -> int:
        logger.error("engine dead: %s", message)
        # The death is diagnosed: a watchdog firing during the linger would send a second Dead
        # with a worse diagnosis (a survivor stuck in the collective the dead rank broke).
        self._watchdog.stop()
        self.pipes.send(Dead(message))
        time.sleep(self.options.dead_linger_s if linger_s is None else linger_s)
        return self._finish(EXIT_FAILED)

    def _finish(self, code: int) -> int:
        """Tell the API process to exit and wait for it (killing it if it lingers)."""
        self.pipes.send(Exit(code))
        stop_api_process(self.api_proc, self.options.api_exit_timeout_s)
        return code

    def _on_stall(self, stalled_for: float) -> None:
        """From the watchdog thread, while the loop is stuck in a step: declare the engine
        dead, let health checks see it, stop the API process and end this process."""
        # A rank that raised or died can leave the others blocked in a collective that never
        # breaks (gloo between survivors): then the workers' reports name it.
        cause = self.engine.diagnose_stall()
        message = (
            f"no engine step completed for {stalled_for:.1f} s while requests were queued "
            f"(limit {self.options.iteration_timeout_s:g} s, rank 0 at step "
            f"{self.engine.step_id}); " + (str(cause) if cause is not None else "a rank is hung")
        )
        logger.error("watchdog: %s", message)
        self.pipes.send(Dead(message))
        time.sleep(self.options.dead_linger_s)
        self.pipes.send(Exit(EXIT_FAILED))
        stop_api_process(self.api_proc, self.options.api_exit_timeout_s)
        self._on_fatal(EXIT_FAILED)  # does not return


def _params(msg: AddRequest) -> SamplingParams | PoolingParams:
    """What the request asks for: pooling when it carries PoolingParams fields."""
    if msg.pooling_params is not None:
        return PoolingParams(**msg.pooling_params)
    return SamplingParams(**msg.sampling_params)


def _delta(request_id: str, out: SequenceOutput) -> Delta:
    """The engine's output of one sample as the API process receives it."""
    return Delta(
        request_id=request_id,
        index=out.index,
        new_token_ids=out.new_token_ids,
        finish_reason=out.finish_reason,
        # Stop strings are the API process's: only a stop token id travels.
        stop_reason=out.stop_reason if isinstance(out.stop_reason, int) else None,
        num_cached_tokens=out.num_cached_tokens,
        queue_time_s=out.queue_time_s,
        scheduled_at=out.scheduled_at,
        logprobs=out.new_logprobs,
        prompt_logprobs=out.prompt_logprobs,
        pooled=None if out.pooled is None else np.asarray(out.pooled, dtype="<f4").tobytes(),
    )
