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

The fast tokenizers release the GIL while they encode. A check that runs out of time keeps its
thread until it ends (a thread cannot be stopped); the constraints pool is small, so hostile
constraints queue behind each other and time out, while requests without one never wait for
it.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tp_engine.server.api.guards import RequestLimits
from tp_engine.server.api.http_errors import bad_request

T = TypeVar("T")

_CONSTRAINT_WORKERS = 2


class RequestWork:
    def __init__(self, limits: RequestLimits) -> None:
        self.limits = limits
        self._requests = ThreadPoolExecutor(limits.request_workers, "tpe-request")
        self._constraints = ThreadPoolExecutor(_CONSTRAINT_WORKERS, "tpe-constraint")

    async def run(
        self, fn: Callable[..., T], *args: Any, orphaned: Callable[[T], object] | None = None
    ) -> T:
        """`fn(*args)` on the requests pool; its exceptions (APIErrors) are raised here.
        `orphaned(result)`: called on the loop with what `fn` returns if the caller was
        cancelled meanwhile (a thread cannot be stopped: a request it sent is aborted so)."""
        loop = asyncio.get_running_loop()
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        future = loop.run_in_executor(self._requests, call)
        if orphaned is None:
            return await future
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(functools.partial(_hand_over, orphaned))
            raise

    async def constraint(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the constraints pool, within the time limit (a 400 past it)."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._constraints, functools.partial(fn, *args))
        timeout = self.limits.constraint_timeout_s
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise bad_request(
                f"the request's output constraint (or tool schemas) took longer than {timeout:g} "
                "s to check (--structured-outputs-timeout); give a simpler one"
            ) from None

    def shutdown(self) -> None:
        self._requests.shutdown(wait=False, cancel_futures=True)
        self._constraints.shutdown(wait=False, cancel_futures=True)


def _hand_over(orphaned: Callable[[Any], object], future: asyncio.Future) -> None:
    """What a cancelled caller's work made, to `orphaned` (nothing if it failed)."""
    if not future.cancelled() and future.exception() is None:
        orphaned(future.result())
