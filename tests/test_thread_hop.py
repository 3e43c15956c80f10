"""`ThreadHop`, the API process's request and constraint pools (`request_work`): calls run on
its own threads, at most `max_workers` at once, and settle their futures on the loop."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tp_engine.server.api.request_work import ThreadHop


def test_a_call_runs_on_a_pool_thread_and_its_result_or_error_comes_back():
    hop = ThreadHop(2, "tpe-test")

    async def main() -> None:
        loop_thread = threading.current_thread()
        ran_on = await hop.submit(threading.current_thread)
        assert ran_on is not loop_thread and ran_on.name == "tpe-test_0"

        def fails() -> None:
            raise ValueError("bad body")

        with pytest.raises(ValueError, match="bad body"):
            await hop.submit(fails)

    asyncio.run(main())
    hop.shutdown()


def test_threads_start_as_calls_need_them_and_never_more_than_max_workers():
    hop = ThreadHop(2, "tpe-lazy")
    assert not [t for t in threading.enumerate() if t.name.startswith("tpe-lazy")]
    running = 0
    most = 0
    names: set[str] = set()
    lock = threading.Lock()

    def work() -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
            names.add(threading.current_thread().name)
        time.sleep(0.1)
        with lock:
            running -= 1

    async def main() -> None:
        for _ in range(3):  # one at a time: the one thread is reused
            await hop.submit(work)
        assert names == {"tpe-lazy_0"}
        await asyncio.gather(*(hop.submit(work) for _ in range(5)))

    asyncio.run(main())
    hop.shutdown()
    assert most == 2  # the five concurrent calls ran two at a time, the rest queued
    assert names == {"tpe-lazy_0", "tpe-lazy_1"}


def test_a_call_cancelled_while_queued_never_runs():
    """A constraint check that timed out before a thread was free is not run (the executor's
    behaviour, which `RequestWork.constraint`'s time limit relies on to keep the pool free)."""
    hop = ThreadHop(1, "tpe-test")
    release = threading.Event()
    ran: list[str] = []

    async def main() -> None:
        busy = hop.submit(lambda: release.wait(5))
        queued = hop.submit(lambda: ran.append("queued"))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(queued, 0.05)
        assert queued.cancelled()
        release.set()
        assert await busy is True
        assert await hop.submit(lambda: "after") == "after"  # the thread is free again

    asyncio.run(main())
    hop.shutdown()
    assert ran == []


def test_shutdown_cancels_what_is_queued_and_refuses_new_calls():
    hop = ThreadHop(1, "tpe-shut")
    started, release = threading.Event(), threading.Event()

    def running() -> str:
        started.set()
        release.wait(5)
        return "done"

    async def main() -> None:
        busy = hop.submit(running)
        queued = hop.submit(lambda: "never")
        assert started.wait(5)
        hop.shutdown()
        release.set()
        assert await busy == "done"  # a running call ends as it would
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(queued, 5)
        with pytest.raises(RuntimeError, match="tpe-shut pool is shut down"):
            hop.submit(lambda: None)

    asyncio.run(main())
    deadline = time.monotonic() + 5
    while any(t.name.startswith("tpe-shut") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the pool's thread did not end"
        time.sleep(0.01)


def test_a_call_that_ends_after_its_loop_closed_leaves_the_thread_working():
    hop = ThreadHop(1, "tpe-test")
    release = threading.Event()

    async def leave() -> None:
        hop.submit(lambda: release.wait(5))  # nobody awaits it: the loop closes first

    asyncio.run(leave())
    release.set()

    async def again() -> str:
        return await hop.submit(lambda: "still serving")

    assert asyncio.run(again()) == "still serving"
    hop.shutdown()
