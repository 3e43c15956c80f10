"""Load and bad input against the real server (`torchrun --nproc-per-node 2`, gloo, CPU, demo
model), started once for the module with the configuration `test_server_api.py` uses, so its
invalid-input table applies unchanged, plus asynchronous scheduling (the GPU default; the API
tests cover the synchronous loop).

- Rounds of many concurrent streaming requests of random lengths, a fifth of whose clients hang
  up at a random point: every request ends (finished, or aborted by its client), the KV pool is
  entirely free afterwards (/metrics: KV usage 0, running 0, waiting 0), and rank 0's resident
  memory does not keep growing from round to round.
- The invalid-input table run while a load runs, with greedy requests sent in between giving
  exactly the tokens they gave before the load.

Figures (requests, disconnects, seconds, RSS) are printed as `LOAD-FIGURE` lines (`-s -n 0`).
"""

from __future__ import annotations

import http.client
import json
import os
import random
import shutil
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.server_harness import Server, shm_entries, torchrun_cmd, wait_until
from tests.test_server_api import (
    API_KEY,
    AUTH,
    BLOCK_SIZE,
    INVALID,
    MAX_MODEL_LEN,
    MODEL,
    NUM_KV_BLOCKS,
)

pytestmark = pytest.mark.slow

REQUESTS_PER_ROUND = int(os.environ.get("TP_LOAD_REQUESTS", "500"))
ROUNDS = 3
CLIENT_THREADS = 500
RSS_GROWTH_BOUND_KB = 150 * 1024  # generous: allocator noise, caches; a leak per request is more
WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "runs",
    "fast",
    "slow",
    "red",
    "blue",
    "sky",
    "tree",
    "under",
    "over",
    "house",
    "river",
    "stone",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    tmpdir = tempfile.mkdtemp(prefix="tpload-")
    env = dict(os.environ, TP_ENGINE_CACHE=str(cache), TMPDIR=tmpdir)
    env.pop("XDG_RUNTIME_DIR", None)
    env.pop("TP_ENGINE_FAULT", None)
    shm_before = shm_entries()
    args = [
        "--port", "0",
        "--api-key", API_KEY,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--num-kv-blocks", str(NUM_KV_BLOCKS),
        "--block-size", str(BLOCK_SIZE),
        "--disable-uvicorn-access-log",
        # As on a GPU (where it is the default): clients hang up while their step is in flight.
        "--async-scheduling",
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("log") / "server.log"
    srv = Server([*torchrun_cmd(2), *args], env, log).wait_ready()
    try:
        yield srv
        assert srv.get("/health")[0] == 200, srv.log_tail()
    finally:
        srv.stop()
        assert shm_entries(srv.run_pids()) <= shm_before
        shutil.rmtree(tmpdir, ignore_errors=True)


def figure(**fields) -> None:
    print("LOAD-FIGURE " + json.dumps(fields), flush=True)


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def one_streaming_client(server: Server, seed: int) -> str:
    """One streaming request; returns "finished" or "disconnected". Raises on anything else."""
    rng = random.Random(seed)
    max_tokens = rng.randint(4, 16)
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
    hang_up_after = rng.randint(0, max_tokens) if rng.random() < 0.2 else None
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": rng.choice([0, 0.8]), "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(body),
            {**AUTH, "Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        events = []
        while True:
            if hang_up_after is not None and len(events) >= hang_up_after:
                conn.sock.shutdown(socket.SHUT_RDWR)
                return "disconnected"
            line = resp.readline()
            assert line, f"stream ended early after {events}"
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                break
            events.append(json.loads(payload))
        assert "error" not in events[-1], events[-1]
        assert events[-1]["usage"]["completion_tokens"] == max_tokens, events[-1]
        assert events[-2]["choices"][0]["finish_reason"] == "length", events[-2]
        return "finished"
    finally:
        conn.close()


def run_round(server: Server, pool: ThreadPoolExecutor, count: int, seed: int) -> dict[str, int]:
    outcomes = list(pool.map(lambda i: one_streaming_client(server, seed + i), range(count)))
    return {k: outcomes.count(k) for k in ("finished", "disconnected")}


def wait_pool_free(server: Server) -> float:
    t0 = time.monotonic()
    wait_until(
        lambda: (
            server.metric("vllm:num_requests_running") == 0
            and server.metric("vllm:num_requests_waiting") == 0
            and server.metric("vllm:kv_cache_usage_perc") == 0
        ),
        timeout_s=30,
        what="the engine to go idle with every KV block free",
    )
    return time.monotonic() - t0


def test_rounds_of_streaming_load_with_disconnects_end_and_free_everything(server):
    rank0 = server.rank0_pid()
    rss = [rss_kb(rank0)]
    totals = {"finished": 0, "disconnected": 0}
    with ThreadPoolExecutor(CLIENT_THREADS) as pool:
        for r in range(ROUNDS):
            t0 = time.monotonic()
            counts = run_round(server, pool, REQUESTS_PER_ROUND, seed=10_000 * r)
            seconds = time.monotonic() - t0
            idle_s = wait_pool_free(server)
            rss.append(rss_kb(rank0))
            for k, v in counts.items():
                totals[k] += v
            assert sum(counts.values()) == REQUESTS_PER_ROUND
            assert counts["disconnected"] > 0
            figure(round=r, requests=REQUESTS_PER_ROUND, **counts, seconds=round(seconds, 1),
                   settle_s=round(idle_s, 2), rank0_rss_mb=round(rss[-1] / 1024, 1))  # fmt: skip
    assert server.get("/health")[0] == 200
    # Memory: round 1 warms up allocators and caches; later rounds must not keep adding.
    growth = rss[-1] - rss[1]
    figure(total_requests=ROUNDS * REQUESTS_PER_ROUND, **totals,
           rss_growth_after_round1_mb=round(growth / 1024, 1))  # fmt: skip
    assert growth < RSS_GROWTH_BOUND_KB, rss


def greedy(server: Server, prompt: str, max_tokens: int) -> list[int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    status, resp = server.post("/v1/completions", body, AUTH)
    assert status == 200, resp
    return resp["choices"][0]["token_ids"]


def test_invalid_input_under_load_is_refused_and_valid_requests_stay_correct(server):
    prompts = ["Hello, my name is", "The capital of France is", "Once upon a time", "def f(x):"]
    reference = {p: greedy(server, p, 8) for p in prompts}  # before any load

    stop = threading.Event()
    load_outcomes: list[str] = []
    errors: list[BaseException] = []

    def load_worker(k: int) -> None:
        i = 0
        while not stop.is_set() and i < 200:  # bounded
            try:
                load_outcomes.append(one_streaming_client(server, 77_000 + 1000 * k + i))
            except BaseException as exc:
                errors.append(exc)
                return
            i += 1

    threads = [threading.Thread(target=load_worker, args=(k,), daemon=True) for k in range(48)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: server.metric("vllm:num_requests_running") > 0, 30, "the load to run")
        checked = 0
        for rep in range(2):
            for name, path, body, headers, expected in INVALID:
                status, resp = server.post(path, body, headers)
                assert status == expected, (name, resp)
                assert set(resp["error"]) == {"message", "type", "param", "code"}, name
                checked += 1
                if checked % 10 == 0:
                    p = prompts[(checked // 10) % len(prompts)]
                    assert greedy(server, p, 8) == reference[p], (rep, name, p)
        for p in prompts:
            assert greedy(server, p, 8) == reference[p], p
        running_during = server.metric("vllm:num_requests_running")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors[:3]
    assert not any(t.is_alive() for t in threads)
    wait_pool_free(server)
    assert server.get("/health")[0] == 200
    figure(invalid_requests=checked, load_requests=len(load_outcomes),
           load_disconnects=load_outcomes.count("disconnected"),
           running_at_end_of_checks=running_during)  # fmt: skip
