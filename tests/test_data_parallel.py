"""Data-parallel replicas behind sglang-router (`launch/serve.py --data-parallel-size N`).

Unit tests of the launcher's pieces (device slices, replica command lines, the worker routes'
payloads), then the real thing on CPU, started once for the module: 2 replicas of the demo model
behind the router (cache-aware policy), with `--restart-dead-replicas`:

- the official `openai` client's completions, chat and streaming through the router; the router
  registered the model under its served name with the replicas' metadata (no "unknown");
- both replicas serve; requests sharing a long prefix land on one replica (its prefix-cache hits
  rise, the other's do not);
- a replica SIGKILLed mid-load: it is reported by name and removed from the router, every
  request sent after the kill succeeds, and the replica is restarted and routed to again;
- SIGKILL of the launcher: every process gone within 10 s, no port, shared memory or run
  directory left.

And a run of one replica behind the router drained by SIGTERM: the stream in flight finishes.
Figures print as `DP-FIGURE` lines (`-s -n 0`).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from shm_ipc.liveness import ProcessWatch
from tests.server_harness import Server, port_is_free, shm_entries, wait_until
from tp_engine.server.api.worker_routes import checkpoint_facts, model_info, server_info
from tp_engine.server.args import build_parser
from tp_engine.server.messages import Hello
from tp_engine.server.rank0.replicas import (
    Replica,
    _ephemeral_low,
    device_slices,
    free_port,
    replica_command,
)
from tp_engine.server.rank0.router_process import ROUTER_ADMIN_KEY_ENV

MODEL = "tp-engine-demo"
ROUTER_READY = re.compile(r"router \(\w+\) serving .*? on http://([^\s;]+):(\d+);")
STARTED = re.compile(r"started replica (\d+) \(pid (\d+), (http://[\d.]+:\d+),")
EXIT_BOUND_S = 10.0

pytestmark = pytest.mark.slow


# -- units -----------------------------------------------------------------------------------------


def test_device_slices_give_replica_i_devices_i_m_to_i_m_plus_m_minus_1():
    visible = [str(d) for d in range(8)]
    assert device_slices(2, 4, visible) == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
    assert device_slices(4, 2, ["7", "6", "5", "4", "3", "2", "1", "0"])[1] == ["5", "4"]
    assert device_slices(3, 1, None) == [None, None, None]  # CPU: all share it
    with pytest.raises(ValueError, match="needs 8 GPUs; 4 are visible"):
        device_slices(2, 4, visible[:4])


def test_replica_command_keeps_the_flags_and_makes_it_one_private_replica():
    argv = ["--data-parallel-size", "2", "--host", "0.0.0.0", "--port", "8000", "-tp", "2",
            "--max-model-len", "300", "--router-policy", "round_robin"]  # fmt: skip
    cmd = replica_command(argv, Replica(index=1, port=12345, devices=["2", "3"]))
    assert cmd[1:3] == ["-m", "tp_engine.server"]
    args = build_parser().parse_args(cmd[3:])
    assert (args.host, args.port, args.replica_index) == ("127.0.0.1", 12345, 1)
    assert (args.tensor_parallel_size, args.max_model_len) == (2, 300)


def test_a_port_handed_to_the_router_is_drawn_below_the_ephemeral_range(tmp_path):
    """The kernel hands out ephemeral ports to every outgoing connection and bind(0): one of
    those, picked for a router that binds it seconds later, was taken first (a CI run)."""
    low = _ephemeral_low()
    ports = {free_port("127.0.0.1") for _ in range(8)}
    if low > 20000:
        assert all(20000 <= port < low for port in ports), (low, ports)
    assert all(port_is_free("127.0.0.1", port) for port in ports)
    (tmp_path / "range").write_text("40000\t60999\n")
    assert _ephemeral_low(str(tmp_path / "range")) == 40000
    assert _ephemeral_low(str(tmp_path / "absent")) == 0


def test_worker_routes_answer_what_the_router_reads(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "x": 1})
    )
    hello = Hello(
        model_dir=str(tmp_path),
        served_model_names=["qwen-8b", "alias"],
        max_model_len=4096,
        vocab_size=1000,
        generation_defaults={},
        api_key=None,
        tensor_parallel_size=4,
    )
    info = model_info(hello, checkpoint_facts(str(tmp_path)))
    assert info["model_type"] == "qwen3" and info["architectures"] == ["Qwen3ForCausalLM"]
    assert info["tokenizer_path"] == info["model_path"] == str(tmp_path)
    assert "x" not in info
    sinfo = server_info(hello)
    assert (sinfo["served_model_name"], sinfo["tp_size"], sinfo["dp_size"]) == ("qwen-8b", 4, 1)
    assert checkpoint_facts(str(tmp_path / "missing")) == {}


def test_bad_data_parallel_size_is_refused_before_anything_starts():
    proc = subprocess.run(
        [sys.executable, "-m", "tp_engine.server", "--data-parallel-size", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--data-parallel-size must be >= 1, got 0" in proc.stderr


# -- the real thing --------------------------------------------------------------------------------


ADMIN_KEY = "test-admin-key"


def launch_env(tmp_path_factory) -> tuple[dict[str, str], Path]:
    cache = tmp_path_factory.mktemp("cache")
    tmpdir = Path(tempfile.mkdtemp(prefix="tpdp-"))
    env = dict(os.environ, TP_ENGINE_CACHE=str(cache), TMPDIR=str(tmpdir))
    env[ROUTER_ADMIN_KEY_ENV] = ADMIN_KEY
    for name in ("XDG_RUNTIME_DIR", "TP_ENGINE_FAULT", "RANK", "WORLD_SIZE"):
        env.pop(name, None)
    return env, tmpdir


def launch(env: dict[str, str], log: Path, dp: int, *extra: str) -> tuple[Server, int]:
    """The launcher with `dp` replicas; returns it (ready) and the router's metrics port."""
    prometheus_port = free_port("127.0.0.1")
    cmd = [
        sys.executable,
        "launch/serve.py",
        "--data-parallel-size", str(dp),
        "--port", "0",
        "--router-prometheus-port", str(prometheus_port),
        "--max-model-len", "512",
        "--num-kv-blocks", "128",
        "--disable-uvicorn-access-log",
        *extra,
    ]  # fmt: skip
    return Server(cmd, env, log, ready_pattern=ROUTER_READY).wait_ready(), prometheus_port


@pytest.fixture(scope="module")
def dp(tmp_path_factory):
    env, tmpdir = launch_env(tmp_path_factory)
    log = tmp_path_factory.mktemp("log") / "launcher.log"
    server, prometheus_port = launch(env, log, 2, "--restart-dead-replicas")
    server.prometheus_port = prometheus_port
    server.tmpdir = tmpdir
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(tmpdir, ignore_errors=True)


def replicas(server: Server) -> dict[int, tuple[int, str]]:
    """Replica index → (pid, url) of its latest start, from the launcher's log."""
    found = {}
    for index, pid, url in STARTED.findall(server.log()):
        found[int(index)] = (int(pid), url)
    return found


def get(url: str, timeout_s: float = 10.0) -> tuple[int, bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        conn.request("GET", parts.path or "/")
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def metric(base_url: str, name: str) -> float:
    """Sum of a metric's samples (by name, or name with labels) at `base_url`/metrics."""
    status, body = get(base_url + "/metrics")
    assert status == 200, body
    text = body.decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def router_workers(server: Server) -> list[dict]:
    status, body = server.get("/workers", {"Authorization": f"Bearer {ADMIN_KEY}"})
    assert status == 200, body
    return json.loads(body)["workers"]


def client(server: Server):
    import openai

    # No client-side retries: a failure must show, not be retried away.
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0, timeout=60
    )


def test_openai_client_completions_chat_and_streaming_through_the_router(dp):
    oai = client(dp)
    assert [m.id for m in oai.models.list().data] == [MODEL]
    done = oai.completions.create(model=MODEL, prompt="Hello there", max_tokens=6)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 6
    chat = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=5
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Stream, please"}],
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 7
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)
    streamed = list(
        oai.completions.create(
            model=MODEL,
            prompt="abc",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert streamed[-1].usage.completion_tokens == 4
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "length"


def test_sglangs_generate_through_the_router(dp):
    """slime's rollout call through the real router, which re-serializes the body with SGLang's
    other fields (`"model": null`, `log_metrics`, `bootstrap_*`, ...): served, and equal to the
    replica's own answer to the same request."""
    body = {"text": "Hello there", "sampling_params": {"max_new_tokens": 5, "temperature": 0.0},
            "return_logprob": True}  # fmt: skip
    status, raw = dp.request("POST", "/generate", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})  # fmt: skip
    assert status == 200, raw
    routed = json.loads(raw)
    _, url = next(iter(replicas(dp).values()))
    direct = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(),
                                    headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(direct, timeout=60) as resp:
        assert json.loads(resp.read())["output_ids"] == routed["output_ids"]
    assert routed["meta_info"]["completion_tokens"] == 5


def test_bad_requests_get_the_replicas_400_and_take_no_replica_out(dp):
    import openai

    oai = client(dp)
    for _ in range(12):  # past the router's circuit-breaker threshold (10), were it on
        with pytest.raises(openai.BadRequestError, match="maximum context length is 512"):
            oai.completions.create(model=MODEL, prompt="hi", max_tokens=600)
    served = spread_load(dp)  # both replicas still take requests
    assert all(n > 0 for n in served.values()), served


def test_the_routers_admin_api_answers_the_launcher_alone(dp):
    # Open by default: anyone reaching the port could add a worker of their own or drop ours.
    assert dp.get("/workers")[0] == 401
    status, _ = dp.request(
        "POST", "/workers", json.dumps({"url": "http://127.0.0.1:9"}).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    assert status == 401
    assert len(router_workers(dp)) == 2  # with the launcher's key


def test_the_router_registered_the_model_with_the_replicas_metadata(dp):
    workers = router_workers(dp)
    urls = sorted(w["url"] for w in workers)
    assert urls == sorted(url for _, url in replicas(dp).values())
    for worker in workers:
        assert worker["model_id"] == MODEL and worker["is_healthy"], worker
        meta = worker["metadata"]
        assert meta["model_type"] == "qwen3" and json.loads(meta["architectures"]) == [
            "Qwen3ForCausalLM"
        ]
        assert meta["served_model_name"] == MODEL and meta["tp_size"] == "1"
        assert Path(meta["model_path"], "tokenizer.json").is_file()  # the tokenizer is local
    # Each replica's own routes: what the router probed, and its vLLM-named metrics.
    url = urls[0]
    status, body = get(url + "/model_info")
    assert status == 200 and json.loads(body)["served_model_name"] == MODEL
    status, body = get(url + "/get_load")
    assert status == 200 and json.loads(body)[0]["dp_rank"] == 0
    status, _ = get(url + "/health_generate", timeout_s=60)
    assert status == 200
    assert metric(url, "vllm:num_requests_running") == 0
    assert "unknown" not in dp.log()  # no model registered as "unknown"


def spread_load(server: Server) -> dict[str, float]:
    """8 concurrent requests whose prompts share no prefix: without a cache match the
    cache-aware policy sends each to the replica with the fewest in flight. Returns how many
    each replica finished."""
    urls = [url for _, url in replicas(server).values()]
    before = {u: metric(u, "vllm:request_success_total") for u in urls}
    oai = client(server)
    words = ["apple", "zebra", "quartz", "mango", "violet", "kettle", "orbit", "dune"]

    def one(word: str) -> None:
        oai.completions.create(model=MODEL, prompt=f"{word} " * 3, max_tokens=24)

    with ThreadPoolExecutor(len(words)) as pool:
        list(pool.map(one, words))
    served = {u: metric(u, "vllm:request_success_total") - before[u] for u in urls}
    assert sum(served.values()) == len(words), served
    return served


def test_both_replicas_serve(dp):
    served = spread_load(dp)
    assert all(n > 0 for n in served.values()), served
    urls = list(served)
    # The router's own metrics count requests per replica URL.
    for url in urls:
        assert (
            metric(
                f"http://127.0.0.1:{dp.prometheus_port}",
                f'smg_worker_cb_outcomes_total{{worker="{url}",outcome="success"}}',
            )
            > 0
        ), url
    print("DP-FIGURE " + json.dumps({"requests_per_replica": list(served.values())}))


def test_requests_sharing_a_prefix_land_on_one_replica(dp):
    urls = [url for _, url in replicas(dp).values()]
    before = {u: metric(u, "vllm:prefix_cache_hits_total") for u in urls}
    oai = client(dp)
    prefix = "The quick brown fox jumps over the lazy dog while the cat watches. " * 6
    for k in range(6):
        out = oai.completions.create(model=MODEL, prompt=prefix + f"Question {k}?", max_tokens=1)
        assert out.usage.prompt_tokens >= 64, out.usage  # a prefix of several KV blocks
    hits = {u: metric(u, "vllm:prefix_cache_hits_total") - before[u] for u in urls}
    # Five of the six find the first one's blocks; all on one replica, none on the other.
    assert sorted(hits.values())[0] == 0, hits
    assert sorted(hits.values())[1] >= 5 * 48, hits
    print("DP-FIGURE " + json.dumps({"prefix_hits_per_replica": list(hits.values())}))


def test_sigkilled_replica_mid_load_every_later_request_succeeds_and_it_comes_back(dp):
    pid, url = replicas(dp)[0]
    oai = client(dp)
    killed_at: list[float] = []
    results: list[tuple[float, str | None]] = []  # (start, error)
    lock = threading.Lock()

    def one(k: int) -> None:
        start = time.monotonic()
        try:
            out = oai.completions.create(
                model=MODEL,
                prompt=f"load {k} " + "x " * (k % 7),
                max_tokens=12,
                extra_body={"ignore_eos": True},  # exactly 12 tokens, whatever is sampled
            )
            error = None if out.usage.completion_tokens == 12 else f"short: {out.usage}"
        except Exception as exc:  # any failure is a finding, reported below
            error = f"{type(exc).__name__}: {exc}"
        with lock:
            results.append((start, error))
        if k == 8:
            os.kill(pid, signal.SIGKILL)
            killed_at.append(time.monotonic())

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(40)))
    assert killed_at
    after = [error for start, error in results if start > killed_at[0]]
    assert len(after) >= 10 and all(e is None for e in after), [e for e in after if e]
    log = dp.log()
    assert re.search(rf"replica 0 \(pid {pid}, {url}, CPU\) was killed by SIGKILL; removed", log)
    # Restarted on its port and put back in the router.
    wait_until(
        lambda: len([w for w in router_workers(dp) if w["is_healthy"]]) == 2, 60, "replica back"
    )
    assert replicas(dp)[0][0] != pid and replicas(dp)[0][1] == url
    assert spread_load(dp)[url] > 0  # the new replica 0 serves
    failed_before = sum(1 for start, e in results if e is not None and start <= killed_at[0])
    print("DP-FIGURE " + json.dumps({"failed_in_flight_at_kill": failed_before}))


def test_sigkilled_launcher_leaves_nothing_behind(dp):
    watches = [ProcessWatch(pid) for pid in dp.descendants()]
    assert len(watches) >= 5, watches  # 2 x (rank 0 + API process) + the router
    ports = [dp.port, dp.prometheus_port] + [
        int(url.rsplit(":", 1)[1]) for _, url in replicas(dp).values()
    ]
    t0 = time.monotonic()
    os.kill(dp.proc.pid, signal.SIGKILL)
    wait_until(lambda: not any(w.alive() for w in watches), EXIT_BOUND_S, "every process gone")
    gone_s = time.monotonic() - t0
    dp.proc.wait(timeout=5)
    for port in ports:
        assert port_is_free("127.0.0.1", port), port
    prefixes = tuple(f"tpe-{w.pid}-" for w in watches)
    assert not {name for name in shm_entries() if name.startswith(prefixes)}
    assert not [p.name for p in dp.tmpdir.iterdir() if p.name.startswith("tpe-")]
    print("DP-FIGURE " + json.dumps({"launcher_sigkill_all_gone_s": round(gone_s, 2)}))


def test_sigterm_drains_the_replicas_behind_the_router(tmp_path_factory, tmp_path):
    env, tmpdir = launch_env(tmp_path_factory)
    # A drain budget far above the stream's length on a loaded machine (the default 10 s cut
    # it at about 50 tokens of 200 with other tests running beside it): the drain is tested,
    # not the speed.
    server, _ = launch(env, tmp_path / "launcher.log", 1, "--shutdown-timeout", "60")
    try:
        watches = [ProcessWatch(pid) for pid in server.descendants()]
        conn = server.connection(timeout_s=60)
        body = {"model": MODEL, "prompt": "Tell me", "max_tokens": 200, "ignore_eos": True,
                "stream": True}  # fmt: skip
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")  # under way
        server.proc.send_signal(signal.SIGTERM)
        text = resp.read().decode()
        conn.close()
        events = [json.loads(x[6:]) for x in text.split("\n\n") if x.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length", text[-500:]
        assert server.proc.wait(timeout=60) == 0, server.log_tail()
        wait_until(lambda: not any(w.alive() for w in watches), 10, "every process gone")
        assert "Traceback" not in server.log(), server.log_tail()
    finally:
        server.stop()
        shutil.rmtree(tmpdir, ignore_errors=True)
