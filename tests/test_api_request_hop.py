"""The API process's hop from the event loop to rank 0's pipe, without rank 0: a request's work
(parsing, checks, tokenizing, its `Generation`) runs on a request-pool thread, never on the loop,
and that thread sends the AddRequest itself; the messages still reach rank 0 in the order they
were sent (an abort never overtakes its AddRequest); a handler cancelled while the pool works
has what the pool sent aborted."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import httpx
import pytest

from tp_engine.sampling_params import SamplingParams
from tp_engine.server.api.engine_client import EngineClient
from tp_engine.server.api.generation import Generation, PromptInput, StopOptions
from tp_engine.server.api.guards import RequestLimits
from tp_engine.server.api.metrics import ServerMetrics
from tp_engine.server.api.request_work import RequestWork
from tp_engine.server.ipc import ApiPipes, EnginePipes, RunDir
from tp_engine.server.messages import (
    AbortRequest,
    AddRequest,
    Control,
    ControlReply,
    Delta,
    EngineOutputs,
    EngineStats,
    Hello,
    decode,
    encode,
)

STATS = EngineStats(1, 0, 0.0, 0, 0, 0)
HELLO = Hello("/m", ["m"], 256, 640, {}, None, 1)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tp_engine.testing import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))


class RecordingPipes:
    """Rank 0 in this process: every sent message is recorded with the thread that sent it;
    an AddRequest is accepted and answered with one token that ends it. Made on the loop."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, Any]] = []
        self._inbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()

    def send(self, msg: Any) -> None:
        self.sent.append((threading.get_ident(), decode(encode(msg))))
        if isinstance(msg, AddRequest):
            self._loop.call_soon_threadsafe(self._answer, msg.request_id)
        elif isinstance(msg, Control):  # /generate asks for the weights' version
            reply = ControlReply(msg.call_id, 200, "", {"weight_version": "default"})
            self._inbox.put_nowait(encode(reply))

    def _answer(self, request_id: str) -> None:
        done = Delta(request_id, 0, [5], "length")
        self._inbox.put_nowait(encode(EngineOutputs([request_id], [], [done], STATS)))

    def async_inbox(self) -> RecordingPipes:
        return self

    async def recv(self) -> bytes:
        return await self._inbox.get()


def test_request_work_runs_on_a_pool_thread_that_sends_the_add(tokenizer, monkeypatch):
    from tp_engine.server.api import serving
    from tp_engine.server.api.app import build_app

    parsed_on: list[int] = []
    built_on: list[int] = []
    parse_body, init = serving.parse_body, Generation.__init__

    def recorded_parse(*args: Any) -> Any:
        parsed_on.append(threading.get_ident())
        return parse_body(*args)

    def recorded_init(self: Generation, *args: Any, **kwargs: Any) -> None:
        built_on.append(threading.get_ident())
        init(self, *args, **kwargs)

    monkeypatch.setattr(serving, "parse_body", recorded_parse)
    monkeypatch.setattr(Generation, "__init__", recorded_init)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    bodies = [
        ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1}),
        ("/v1/completions", {"prompt": "hello there", "max_tokens": 1, "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        # An output constraint: checked on the constraints pool, then back to the requests pool.
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 1, "structured_outputs": {
            "json": schema}}),
    ]  # fmt: skip

    async def main() -> int:
        pipes = RecordingPipes()
        client = EngineClient(pipes, HELLO, ServerMetrics("m"), "/nonexistent", os.getpid())  # type: ignore[arg-type]
        app = build_app(client, tokenizer)
        client.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            for path, body in bodies:
                resp = await http.post(path, json={"model": "m", **body})
                assert resp.status_code == 200, resp.text
        await client.stop()
        assert len(pipes.sent) == len(bodies)
        for _, msg in pipes.sent:
            assert isinstance(msg, AddRequest)
        adds_on = [thread for thread, _ in pipes.sent]
        loop_thread = threading.get_ident()
        assert loop_thread not in parsed_on + built_on + adds_on
        # The thread that built each Generation sent it: no hop back to the loop between.
        assert adds_on == built_on
        return len(parsed_on)

    assert asyncio.run(main()) == len(bodies)


def test_sglangs_generate_parses_and_checks_its_body_on_a_pool_thread(tokenizer, monkeypatch):
    from tp_engine.server.api import sglang_routes
    from tp_engine.server.api.app import build_app

    parsed_on: list[int] = []
    convert = sglang_routes._completion_request

    def recorded(*args: Any) -> Any:
        parsed_on.append(threading.get_ident())
        return convert(*args)

    monkeypatch.setattr(sglang_routes, "_completion_request", recorded)

    async def main() -> None:
        pipes = RecordingPipes()
        client = EngineClient(pipes, HELLO, ServerMetrics("m"), "/nonexistent", os.getpid())  # type: ignore[arg-type]
        app = build_app(client, tokenizer)
        client.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
            resp = await http.post("/generate", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.json()["output_ids"] == [5]
            bad = await http.post("/generate", json={"input_ids": [1], "model": "m", "bogus": 1})
            assert bad.status_code == 400, bad.text  # refused as before, from the pool
        await client.stop()
        assert len(parsed_on) == 1 and threading.get_ident() not in parsed_on

    asyncio.run(main())


def test_an_abort_right_after_the_pools_add_reaches_rank_0_after_it(tokenizer):
    """Pool threads send AddRequests while the loop aborts each as soon as its Generation is
    back: rank 0 must read every AddRequest before its abort. Two sockets (one per sender)
    would be fair-queued by rank 0's PULL socket, and aborts would overtake."""
    run = RunDir.create()
    engine = EnginePipes(run)
    api = ApiPipes(run.path)
    work = RequestWork(RequestLimits(request_workers=4))
    stop = StopOptions([], False, True, 0)
    count = 200

    def sent(gen: Generation) -> Generation:
        gen.send()
        return gen

    async def main() -> None:
        client = EngineClient(api, HELLO, ServerMetrics("m"), run.path, os.getpid())
        params = SamplingParams(max_tokens=4)

        async def one(i: int) -> None:
            gen = Generation(
                client, tokenizer, f"r{i}", [PromptInput([1, 2, 3])], lambda p: params, 1, stop
            )
            (await work.run(sent, gen)).close()

        await asyncio.gather(*(one(i) for i in range(count)))

    try:
        asyncio.run(main())
        order: list[tuple[str, str]] = []
        deadline = time.monotonic() + 30
        while len(order) < 2 * count and time.monotonic() < deadline:
            if not engine.poll(0.5):
                continue
            msg = engine.recv_nowait()
            assert isinstance(msg, (AddRequest, AbortRequest)), msg
            order.append((type(msg).__name__, msg.request_id))
        assert len(order) == 2 * count
        for i in range(count):
            rid = f"r{i}-0"
            assert order.index(("AddRequest", rid)) < order.index(("AbortRequest", rid)), rid
    finally:
        work.shutdown()
        api.close()
        engine.close()
        run.remove()


def test_a_cancelled_callers_result_goes_to_orphaned():
    """The handler went away while a pool thread worked (and, in the server, sent the request):
    what the thread returns is handed to `orphaned` (which aborts it), once it is done."""
    work = RequestWork(RequestLimits())
    orphans: list[str] = []

    def slow() -> str:
        time.sleep(0.2)
        return "sent"

    async def main() -> None:
        task = asyncio.create_task(work.run(slow, orphaned=orphans.append))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert orphans == []  # the thread is still working
        deadline = time.monotonic() + 5
        while not orphans and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    asyncio.run(main())
    work.shutdown()
    assert orphans == ["sent"]


def test_a_pool_thread_sees_a_dead_engine_and_adds_nothing(tokenizer):
    from tp_engine.server.api.http_errors import APIError

    work = RequestWork(RequestLimits())

    async def main() -> RecordingPipes:
        pipes = RecordingPipes()
        client = EngineClient(pipes, HELLO, ServerMetrics("m"), "/nonexistent", os.getpid())  # type: ignore[arg-type]
        client._fail_all("boom")
        gen = Generation(
            client, tokenizer, "x", [PromptInput([1])], lambda p: SamplingParams(), 1,
            StopOptions([], False, True, 0),
        )  # fmt: skip
        with pytest.raises(APIError, match="the engine is dead: boom"):
            await work.run(gen.send)
        return pipes

    pipes = asyncio.run(main())
    work.shutdown()
    assert pipes.sent == []


def test_what_a_cancelled_handler_had_sent_is_aborted(tokenizer):
    """`serving._close_sent` finds the Generation in what each route's pool call returns (a
    completion's `(req, prepared, gen)`, a chat's `(req, prepared, (gen, parsers))`)."""
    from tp_engine.server.api.serving import _close_sent

    async def main() -> list[Any]:
        pipes = RecordingPipes()
        client = EngineClient(pipes, HELLO, ServerMetrics("m"), "/nonexistent", os.getpid())  # type: ignore[arg-type]
        stop = StopOptions([], False, True, 0)
        for i, shape in enumerate((lambda g: g, lambda g: ("req", None, g),
                                   lambda g: ("req", None, (g, "parsers")))):  # fmt: skip
            gen = Generation(
                client, tokenizer, f"c{i}", [PromptInput([1])], lambda p: SamplingParams(), 1, stop
            )
            gen.send()
            _close_sent(shape(gen))
        _close_sent(("req", None, None))  # a constraint still to check: nothing was sent
        return [msg for _, msg in pipes.sent]

    sent = asyncio.run(main())
    assert [(type(m).__name__, m.request_id) for m in sent] == [
        (kind, f"c{i}-0") for i in range(3) for kind in ("AddRequest", "AbortRequest")
    ]
