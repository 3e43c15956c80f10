"""A server whose engine dies: in-flight requests fail, /health turns 503, the server exits
non-zero, and no process, shared memory or socket outlives it.

Two ways to die, each with its own server (and both launch modes between them):
- a rank that raises (plain Python with --tensor-parallel-size 2: rank 0 spawns rank 1), seen by
  rank 0 as EngineDeadError naming the rank;
- a rank that hangs (torchrun), which only the watchdog can notice: rank 0 itself is stuck in a
  collective and never returns from its step.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from tests.server_harness import Server, parse_sse, shm_entries, torchrun_cmd

pytestmark = pytest.mark.slow

LINGER_S = 4


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def start(cmd, cache, fault, tmp_path):
    # A short TMPDIR of its own (socket paths must stay short); removed by the test's finally.
    tmpdir = tempfile.mkdtemp(prefix="srvfault-")
    env = dict(os.environ, TP_ENGINE_CACHE=str(cache), TMPDIR=tmpdir, TP_ENGINE_FAULT=fault)
    env.pop("XDG_RUNTIME_DIR", None)
    args = ["--port", "0", "--num-kv-blocks", "64", "--max-model-len", "512",
            "--engine-iteration-timeout", "3", "--engine-dead-linger", str(LINGER_S)]  # fmt: skip
    return Server([*cmd, *args], env, tmp_path / "server.log").wait_ready(), Path(tmpdir)


def check_dies_cleanly(server, tmpdir, shm_before):
    assert server.proc.wait(timeout=60) != 0, server.log_tail()
    assert not server.alive_pids(), f"left running: {server.alive_pids()}\n{server.log_tail()}"
    assert shm_entries(server.run_pids()) <= shm_before
    assert not [p for p in tmpdir.iterdir() if p.name.startswith("tpe-")]


def test_a_failing_rank_fails_in_flight_requests_and_the_server(cache, tmp_path):
    shm_before = shm_entries()
    cmd = [sys.executable, "launch/serve.py", "--tensor-parallel-size", "2"]
    server, tmpdir = start(cmd, cache, "rank=1,step=3,kind=raise", tmp_path)
    try:
        body = {"prompt": "Hello", "max_tokens": 20, "ignore_eos": True}
        status, resp = server.post("/v1/completions", body)
        assert status == 500, resp
        assert "rank 1" in resp["error"]["message"]
        assert "injected fault" in resp["error"]["message"]
        status, data = server.get("/health")
        assert status == 503 and "rank 1" in json.loads(data)["error"]["message"]
        status, resp = server.post("/v1/completions", body)
        assert status == 503 and resp["error"]["code"] == "engine_dead"
        check_dies_cleanly(server, tmpdir, shm_before)
    finally:
        server.stop()
        shutil.rmtree(tmpdir, ignore_errors=True)


def test_the_watchdog_declares_a_hung_engine_dead(cache, tmp_path):
    shm_before = shm_entries()
    server, tmpdir = start(torchrun_cmd(2), cache, "rank=1,step=3,kind=stall", tmp_path)
    try:
        body = {"prompt": "Hello", "max_tokens": 20, "ignore_eos": True, "stream": True}
        status, data = server.request(
            "POST",
            "/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        assert status == 200
        events = parse_sse(data)
        assert events[-1] == "[DONE]"
        assert "no engine step completed" in events[-2]["error"]["message"]
        assert server.get("/health")[0] == 503
        check_dies_cleanly(server, tmpdir, shm_before)
        assert "watchdog" in server.log()
    finally:
        server.stop()
        shutil.rmtree(tmpdir, ignore_errors=True)
