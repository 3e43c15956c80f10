"""Request traces (`tp_engine.server.request_trace`) and the TTFT breakdown built on them
(`benchmarks/ttft_breakdown.py`): the writer, the join, the real server's stages in order on
one clock with the client's; and which requests skip the constraints pool (`gives_constraint`,
the fix the breakdown led to)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from types import SimpleNamespace

import pytest

from benchmarks.ttft_breakdown import GAPS, breakdown, read_traces
from tp_engine.server import request_trace
from tp_engine.server.api.constraints import gives_constraint, output_constraint
from tp_engine.server.api.http_errors import APIError
from tp_engine.server.api.protocol import ChatCompletionRequest, CompletionRequest

ORDER = ["api_route", "api_add", "r0_add", "r0_first_out", "r0_sent", "api_delta", "api_chunk"]


def test_off_without_the_variable_and_one_line_per_event_with_it(tmp_path, monkeypatch):
    monkeypatch.delenv(request_trace.ENV_VAR, raising=False)
    assert request_trace.for_process("api") is None
    monkeypatch.setenv(request_trace.ENV_VAR, str(tmp_path / "t"))
    trace = request_trace.for_process("api")
    assert trace is not None
    trace.mark("api_add", "r-0", t=1.5)
    trace.mark_once("api_delta", "r-0")
    trace.mark_once("api_delta", "r-0")  # a later delta of the same request: not recorded
    trace.mark("step", "", t=2.0, start=1.0, end=2.0, outputs=3)
    lines = [json.loads(x) for x in (tmp_path / "t" / f"api-{os.getpid()}.jsonl").read_text().split("\n") if x]  # fmt: skip
    assert [(x["stage"], x["id"]) for x in lines] == [
        ("api_add", "r-0"), ("api_delta", "r-0"), ("step", ""),
    ]  # fmt: skip
    assert lines[0]["t"] == 1.5 and lines[2]["start"] == 1.0


def test_breakdown_splits_the_ttft_into_consecutive_gaps(tmp_path):
    """Synthetic times: the request reached rank 0 during a step, which it waited out."""
    t = dict(api_route=1.0, api_add=2.0, r0_add=5.5, r0_first_out=20.0, r0_sent=20.5,
             api_delta=21.0, api_chunk=22.0)  # fmt: skip
    lines = [{"t": v / 1e3, "stage": k, "id": "cmpl-1-0"} for k, v in t.items()]
    lines += [{"t": e / 1e3, "stage": "step", "id": "", "start": s / 1e3, "end": e / 1e3}
              for s, e in ((0.0, 5.0), (5.6, 20.0))]  # fmt: skip
    (tmp_path / "x.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = SimpleNamespace(success=True, response_id="cmpl-1", sent_at_s=0.0005,
                             first_chunk_at_s=0.0225, ttft_s=0.022)  # fmt: skip
    events, steps = read_traces(tmp_path)
    [row] = breakdown([result], events, steps)
    expected = dict(http_in=0.5, api_parse=1.0, wait_step=3.0, ipc_in=0.5, engine=14.5,
                    r0_out=0.5, ipc_out=0.5, api_out=1.0, http_out=0.5)  # fmt: skip
    assert {k: round(row[k], 6) for k in expected} == expected
    assert sum(row[name] for name, _, _ in GAPS) == pytest.approx(row["ttft"]) == 22.0
    assert row["steps"] == 1.0  # the step that ended at r0_first_out; the waited one is before


def test_the_real_server_traces_every_stage_in_order_on_the_clients_clock(tmp_path):
    from benchmarks.serving_client import random_requests, run_benchmark
    from tests.server_harness import Server
    from tp_engine.testing import build_random_qwen3

    model = build_random_qwen3(
        tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
        intermediate_size=64, max_position_embeddings=256,
    )  # fmt: skip
    env = dict(os.environ, **{request_trace.ENV_VAR: str(tmp_path / "trace")})
    env.pop("TP_ENGINE_FAULT", None)
    cmd = [sys.executable, "launch/serve.py", "--model", str(model), "--port", "0",
           "--max-model-len", "256", "--num-kv-blocks", "32"]  # fmt: skip
    srv = Server(cmd, env, tmp_path / "server.log").wait_ready()
    try:
        model_name = json.loads(srv.get("/v1/models")[1])["data"][0]["id"]
        requests = random_requests(3, 40, 4, vocab_size=500)
        url = f"http://{srv.host}:{srv.port}"
        results, _ = asyncio.run(run_benchmark(url, model_name, requests, 20.0))
    finally:
        srv.stop()
    assert all(r.success and r.response_id for r in results), [r.error for r in results]
    events, steps = read_traces(tmp_path / "trace")
    assert steps and all(s["start"] <= s["end"] for s in steps)
    for r in results:
        stages = events[f"{r.response_id}-0"]
        times = [r.sent_at_s, *(stages[s]["t"] for s in ORDER), r.first_chunk_at_s]
        # One clock: the client's send precedes the server's first mark, its first chunk
        # follows the last, and the server's stages come in the request's order.
        assert times == sorted(times), dict(zip(["client", *ORDER, "client"], times, strict=True))
    rows = breakdown(results, events, steps)
    assert len(rows) == len(results) and all(row["steps"] >= 1 for row in rows)


# -- which requests skip the constraints pool ----------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [{"guided_regex": "a+"}, {"guided_json": {"type": "object"}}, {"guided_choice": ["a"]},
     {"response_format": {"type": "json_object"}}, {"structured_outputs": {"regex": "a"}}],
)  # fmt: skip
def test_requests_with_a_constraint_go_to_the_pool(fields):
    assert gives_constraint(CompletionRequest(prompt="hi", **fields))
    messages = [{"role": "user", "content": "hi"}]
    assert gives_constraint(ChatCompletionRequest(messages=messages, **fields))


def test_requests_without_one_are_checked_inline_with_the_same_refusals():
    assert not gives_constraint(CompletionRequest(prompt="hi", max_tokens=3))
    messages = [{"role": "user", "content": "hi"}]
    assert not gives_constraint(ChatCompletionRequest(messages=messages))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert gives_constraint(ChatCompletionRequest(messages=messages, tools=[tool]))
    assert gives_constraint(ChatCompletionRequest(messages=messages, tool_choice="none"))
    # Nothing to parse, but still an option the server refuses: the inline check refuses it.
    req = CompletionRequest(prompt="hi", guided_whitespace_pattern=" ")
    assert not gives_constraint(req)
    with pytest.raises(APIError, match="guided_whitespace_pattern"):
        output_constraint(req)
