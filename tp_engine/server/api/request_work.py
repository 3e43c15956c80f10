"""A request's CPU work, off the API process's event loop.

The loop only moves bytes: it answers /health, streams tokens and reads request bodies, so that
one request's parsing, tokenizing or constraint check never delays another's. The work runs on
two thread pools:

    pool          what runs there                                    bound
    requests      body parsing, chat templates, tokenizing,          the body limit (413) and the
                  /tokenize, /detokenize                             prompt-length check before
                                                                     tokenizing
    constraints   output constraints and tool schemas: size and      --structured-outputs-timeout:
                  nesting checks, then parsing (no tokenizer)        a slower check is a 400

A completion or chat request's last trip to the requests pool also builds its `Generation` and
sends its AddRequest from there (`serving`): the loop's only part is to hand the body over and,
afterwards, to wait for the verdict and stream; the send does not wait for a second thread switch,
back to the loop (`EngineClient` says how the order of messages is kept). Each call runs in a
copy of the caller's context, so the request's trace marks (`request_trace`) are the same as on
the loop.

The pools are `ThreadHop`s, not `run_in_executor` on a `ThreadPoolExecutor`: a call reaches its
thread through one queue put and comes back through one `call_soon_threadsafe`, where the
executor's futures, condition variables and work items cost two to three times that when the
process has been idle and its caches are cold, which is how a server sees most requests
(`benchmarks/results/cpu/api-hops/`).

The fast tokenizers release the GIL while they encode. A check that runs out of time keeps its
thread until it ends (a thread cannot be stopped); the constraints pool is small, so hostile
constraints queue behind each other and time out, while requests without one never wait for
it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from tp_engine.server.api.guards import RequestLimits
from tp_engine.server.api.http_errors import bad_request

T = TypeVar("T")

_CONSTRAINT_WORKERS = 2


class RequestWork:
    def __init__(self, limits: RequestLimits) -> None:
        self.limits = limits
        self._requests = ThreadHop(limits.request_workers, "tpe-request")
        self._constraints = ThreadHop(_CONSTRAINT_WORKERS, "tpe-constraint")

    async def run(
        self, fn: Callable[..., T], *args: Any, orphaned: Callable[[T], object] | None = None
    ) -> T:
        """`fn(*args)` on the requests pool; its exceptions (APIErrors) are raised here.
        `orphaned(result)`: called on the loop with what `fn` returns if the caller was
        cancelled meanwhile (a thread cannot be stopped: a request it sent is aborted so)."""
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        future = self._requests.submit(call)
        if orphaned is None:
            return await future
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(functools.partial(_hand_over, orphaned))
            raise

    async def constraint(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the constraints pool, within the time limit (a 400 past it)."""
        future = self._constraints.submit(functools.partial(fn, *args))
        timeout = self.limits.constraint_timeout_s
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise bad_request(
                f"the request's output constraint (or tool schemas) took longer than {timeout:g} "
                "s to check (--structured-outputs-timeout); give a simpler one"
            ) from None

    def shutdown(self) -> None:
        self._requests.shutdown()
        self._constraints.shutdown()


class ThreadHop:
    """Up to `max_workers` threads (started as calls need them) that run the calls the event
    loop hands over and settle each one's future on the loop. A call still queued when its
    future is cancelled (its caller timed out or left) does not run."""

    def __init__(self, max_workers: int, name: str) -> None:
        self._max_workers = max_workers
        self._name = name
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = 0  # threads started so far (they never end before shutdown)
        self._idle = 0  # threads done with a call and not yet claimed by a new one
        self._closed = False

    def submit(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """`fn()` on a pool thread; its result or exception settles the returned future."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self._name} pool is shut down")
            if self._idle:
                self._idle -= 1
            elif self._started < self._max_workers:
                name = f"{self._name}_{self._started}"
                threading.Thread(target=self._work, name=name, daemon=True).start()
                self._started += 1
        self._queue.put((loop, future, fn))
        return future

    def shutdown(self) -> None:
        """Cancel what is queued and let the threads end once their calls return."""
        with self._lock:
            self._closed = True
            threads = self._started
        while True:
            try:
                call = self._queue.get_nowait()
            except queue.Empty:
                break
            if call is not None:
                _on_loop(call[0], call[1].cancel)
        for _ in range(threads):
            self._queue.put(None)

    def _work(self) -> None:
        while (call := self._queue.get()) is not None:
            loop, future, fn = call
            outcome = _outcome(future, fn)
            with self._lock:  # idle before the caller hears: its next call finds this thread
                self._idle += 1
            if outcome is not None:
                _on_loop(loop, _settle, future, *outcome)
            del call, future, fn, outcome  # nothing of a finished call outlives it here


_Call = tuple[asyncio.AbstractEventLoop, asyncio.Future, Callable[[], Any]]


def _outcome(
    future: asyncio.Future, fn: Callable[[], Any]
) -> tuple[Any, BaseException | None] | None:
    """`fn()`'s result or exception; None, without running it, if its caller has cancelled
    (a benign race: a cancel just after this check only discards the result)."""
    if future.cancelled():
        return None
    try:
        return fn(), None
    except BaseException as exc:  # the caller's to raise, as an executor's are
        return None, exc


def _on_loop(loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: Any) -> None:
    """`callback(*args)` on `loop`, from another thread; nothing if the loop has closed."""
    with contextlib.suppress(RuntimeError):  # closed: nobody waits for the call any more
        loop.call_soon_threadsafe(callback, *args)


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    """(loop) The call's outcome, unless its caller has cancelled the future meanwhile."""
    if future.cancelled():
        return
    if exc is None:
        future.set_result(result)
    else:
        future.set_exception(exc)


def _hand_over(orphaned: Callable[[Any], object], future: asyncio.Future) -> None:
    """What a cancelled caller's work made, to `orphaned` (nothing if it failed)."""
    if not future.cancelled() and future.exception() is None:
        orphaned(future.result())
