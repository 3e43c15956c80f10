"""The API process's view of rank 0: send requests and aborts, route what comes back.

Ownership: one `EngineClient` per API process, used from the asyncio event loop, except `add`
(and `admitting`), which a request-pool thread calls too: a completion is parsed, checked and
sent to rank 0 by the thread that parsed it, so that the AddRequest does not wait for a second
thread switch, back to the loop (`serving`). Each in-flight HTTP request registers its engine
request ids (one per prompt) with one `asyncio.Queue`; the dispatcher task reads rank 0's
messages and puts `(request_id, event)` on the owner's queue, where an event is `ACCEPTED`, a
`Rejected`, a `Delta` (of one sample) or an `EngineDied`. Messages for ids no longer registered
(the client left) are dropped. The owner releases its ids when it is done (`Generation.close`).

Order, with senders on two threads:

- an id is registered before its AddRequest is sent, so no verdict finds it missing;
- every message goes through the one socket, under its lock (`ApiPipes.send`), so rank 0 reads
  them in the order they were sent; an abort comes from the loop after the thread that sent
  the AddRequest has handed the `Generation` back (the future's result), so it never overtakes
  it;
- `admitting` is held from the check for a dead or draining engine to the last AddRequest's
  send, and by the loop while it marks the engine dead or draining and fails what is
  registered: a request either sees the flag (503) or is registered in time to be failed.

Sending never blocks or awaits (see `ipc`), so an abort can be sent from the `finally` of a
coroutine that is being cancelled because its client disconnected.

Admin routes `await control(op, args)`: a future per call id, resolved by rank 0's
`ControlReply` (or by the engine's death, as a 503).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shm_ipc.liveness import ProcessWatch
from tp_engine.lora_request import LoRARequest
from tp_engine.server import request_trace
from tp_engine.server.api.metrics import ServerMetrics
from tp_engine.server.ipc import ApiPipes, RunDir
from tp_engine.server.messages import (
    AbortRequest,
    AddRequest,
    Bootstrap,
    Control,
    ControlReply,
    Dead,
    Drain,
    EngineOutputs,
    Exit,
    Hello,
    decode,
)

logger = logging.getLogger(__name__)

ACCEPTED = "accepted"
_PARENT_CHECK_S = 1.0


@dataclass(frozen=True)
class EngineDied:
    message: str


class EngineClient:
    def __init__(
        self, pipes: ApiPipes, hello: Hello, metrics: ServerMetrics, run_dir: str, parent_pid: int
    ) -> None:
        self.pipes = pipes
        self.hello = hello
        self.metrics = metrics
        self._run_dir = run_dir
        self._parent = ProcessWatch(parent_pid)
        self._owners: dict[str, asyncio.Queue] = {}
        # Why the engine cannot serve any more; None while it can. Both flags are set under
        # `admitting`, which a sender holds from its check of them to its last AddRequest.
        self.dead: str | None = None
        self.draining = False
        self.admitting = threading.RLock()
        self.exit_code: int | None = None
        self.on_exit: Callable[[int], None] = lambda code: None
        self._tasks: list[asyncio.Task] = []
        self._calls: dict[int, asyncio.Future[ControlReply]] = {}
        self._call_ids = itertools.count(1)
        # Per-request timestamps for the TTFT breakdown; None unless asked for (request_trace).
        self.trace = request_trace.for_process("api")

    # -- requests ----------------------------------------------------------------------------------

    def add(
        self,
        queue: asyncio.Queue,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: dict[str, Any],
        pooling_params: dict[str, Any] | None = None,
        lora_request: LoRARequest | None = None,
        constraint_checks: dict[str, dict[str, Any]] | None = None,
        bootstrap: Bootstrap | None = None,
    ) -> None:
        """Send one engine request; its events go to `queue`. With `pooling_params` it pools
        its prompt instead of sampling (`sampling_params` is then empty); `bootstrap`: its
        prefill/decode pairing (a router's). From the loop or a request-pool thread."""
        msg = AddRequest(
            request_id,
            prompt_token_ids,
            sampling_params,
            pooling_params=pooling_params,
            lora_request=lora_request,
            constraint_checks=constraint_checks or {},
            bootstrap=bootstrap,
        )
        with self.admitting:
            self._owners[request_id] = queue  # before the send: its verdict finds it
            if self.trace is not None:
                now = time.monotonic()  # before the first write: the marks are not the request's
                route_start = request_trace.route_start()
                if route_start is not None:
                    self.trace.mark("api_route", request_id, t=route_start)
                self.trace.mark("api_add", request_id, t=now)
            self.pipes.send(msg)

    def abort(
        self, request_id: str, sample_indices: list[int] | None = None, *, stopped: bool = False
    ) -> None:
        """Stop a request's samples on rank 0 (all when `sample_indices` is None), freeing
        their KV blocks. Aborting all of them also forgets the request here."""
        if request_id not in self._owners:
            return
        if sample_indices is None:
            del self._owners[request_id]
        if self.exit_code is None:
            self.pipes.send(AbortRequest(request_id, sample_indices, stopped))

    def release(self, request_id: str) -> None:
        """Forget a request that rank 0 has finished or rejected (nothing is sent)."""
        self._owners.pop(request_id, None)

    async def control(self, op: str, args: dict[str, Any] | None = None) -> ControlReply:
        """Run an operation on the engine (`tp_engine.server.rank0.control_ops`) and wait for its
        reply; a dead or exiting engine answers 503 at once."""
        if self.dead is not None or self.exit_code is not None:
            return ControlReply(0, 503, f"the engine is not serving: {self.dead or 'exiting'}", {})
        call_id = next(self._call_ids)
        reply: asyncio.Future[ControlReply] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = reply
        self.pipes.send(Control(call_id, op, dict(args or {})))
        try:
            return await reply
        finally:
            self._calls.pop(call_id, None)

    # -- background tasks --------------------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._dispatch(), name="engine-dispatcher"),
            asyncio.create_task(self._watch_parent(), name="engine-parent-watch"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _dispatch(self) -> None:
        inbox = self.pipes.async_inbox()
        while True:
            frame = await inbox.recv()
            try:
                done = self._handle(decode(frame))
            except Exception as exc:
                # A message this process cannot read would leave requests waiting forever:
                # fail them all and exit, so that rank 0 notices and shuts the server down.
                logger.exception("API process: cannot handle rank 0's message")
                self._fail_all(f"the API process could not read rank 0's message: {exc}")
                self.exit_code = 1
                self.on_exit(1)
                return
            if done:
                return

    def _handle(self, msg: object) -> bool:
        """Apply one message from rank 0; True once it said Exit."""
        if isinstance(msg, EngineOutputs):
            for rid in msg.accepted:
                self._deliver(rid, ACCEPTED)
            for rejected in msg.rejected:
                self._deliver(rejected.request_id, rejected)
                self._owners.pop(rejected.request_id, None)
            for delta in msg.deltas:
                self._deliver(delta.request_id, delta)
                if self.trace is not None:
                    self.trace.mark_once("api_delta", delta.request_id)
            self.metrics.set_engine_stats(msg.stats)
        elif isinstance(msg, ControlReply):
            call = self._calls.get(msg.call_id)
            if call is not None and not call.done():
                call.set_result(msg)
        elif isinstance(msg, Drain):
            logger.info("shutting down: refusing new requests, %d in flight", len(self._owners))
            with self.admitting:
                self.draining = True
        elif isinstance(msg, Dead):
            logger.error("engine dead: %s", msg.message)
            self._fail_all(msg.message)
        elif isinstance(msg, Exit):
            with self.admitting:
                self.draining = True
                if self._owners:  # rank 0 left with requests in flight: end them with an error
                    self._fail_all(f"the server is exiting (code {msg.code})")
            self._fail_calls(f"the server is exiting (code {msg.code})")
            self.exit_code = msg.code
            self.on_exit(msg.code)
            return True
        else:
            logger.warning("API process: ignoring unexpected %s", type(msg).__name__)
        return False

    def _fail_all(self, message: str) -> None:
        with self.admitting:  # no request registers between the flag and the clear
            self.dead = message
            owners = list(self._owners.items())
            self._owners.clear()
        self._fail_calls(message)
        for rid, queue in owners:
            queue.put_nowait((rid, EngineDied(message)))

    def _fail_calls(self, message: str) -> None:
        for call_id, call in list(self._calls.items()):
            if not call.done():
                call.set_result(ControlReply(call_id, 503, message, {}))

    def _deliver(self, request_id: str, event: Any) -> None:
        queue = self._owners.get(request_id)
        if queue is not None:
            queue.put_nowait((request_id, event))

    async def _watch_parent(self) -> None:
        """Rank 0 killed outright cannot send Exit: notice, remove its leftovers, and go."""
        while True:
            await asyncio.sleep(_PARENT_CHECK_S)
            if not self._parent.alive():
                logger.error("rank 0 (pid %d) died; the API process exits", self._parent.pid)
                RunDir(self._run_dir).remove()
                os._exit(1)
