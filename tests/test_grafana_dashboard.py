"""vLLM's own Grafana dashboard reads only series that our `/metrics` serves.

The dashboard (`tests/data/vllm_grafana/grafana.json`, vLLM's file unchanged; see the NOTICE
there) is parsed for every series and label its queries use (`tests/dashboard_queries.py`).
Here, in one process: the parse finds exactly the series the dashboard names, and the API
process's registry, after one request has run through `Generation`, serves every one of them,
with vLLM's definitions of the request phases checked on a fake clock. Against the real server
(two ranks): `tests/test_server_api.py::test_vllms_grafana_dashboard_reads_only_served_series`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest

from tests import dashboard_queries
from tp_engine.server.api.metrics import ServerMetrics
from tp_engine.server.messages import Delta, EngineStats

REPO_ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = REPO_ROOT / "tests" / "data" / "vllm_grafana" / "grafana.json"
EXAMPLE = REPO_ROOT / "examples" / "prometheus_grafana" / "grafana.json"

# What vLLM's dashboard at e88892c reads, written out by hand from its panels.
HISTOGRAMS = ("e2e_request_latency_seconds", "time_per_output_token_seconds",
              "time_to_first_token_seconds")  # fmt: skip
EXPECTED_SERIES = {
    *(f"vllm:{h}_{part}" for h in HISTOGRAMS for part in ("bucket", "sum", "count")),
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_requests_running",
    "vllm:num_requests_swapped",
    "vllm:num_requests_waiting",
    "vllm:gpu_cache_usage_perc",
    "vllm:cpu_cache_usage_perc",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
}


def test_the_example_is_the_tested_dashboard():
    assert EXAMPLE.read_bytes() == DASHBOARD.read_bytes()


def test_the_parse_finds_every_series_and_label_the_dashboard_reads():
    refs = dashboard_queries.references(dashboard_queries.load(DASHBOARD))
    assert {r.series for r in refs} == EXPECTED_SERIES | {""}  # "": label_values(model_name)
    assert all(("model_name", "=", "$model_name") in r.matchers for r in refs if r.series)
    grouped = {r.series: r.grouped_by for r in refs if r.grouped_by}
    assert grouped["vllm:request_success_total"] == {"finished_reason"}
    assert grouped["vllm:e2e_request_latency_seconds_bucket"] == {"le"}
    assert grouped[""] == {"model_name"}
    assert "vllm:e2e_request_latency_seconds_sum" not in grouped  # `by(le)` is the buckets'


def test_missing_names_what_a_scrape_lacks():
    refs = dashboard_queries.parse(
        'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}'
        "[5m])) + vllm:num_requests_running"
    )
    text = 'vllm:request_success_total{model_name="m"} 1.0\n'
    assert dashboard_queries.missing(set(refs), text, {"model_name": "m"}) == [
        "vllm:num_requests_running: no such series",
        "vllm:request_success_total: no sample has ['finished_reason', 'model_name']",
    ]
    text = 'vllm:request_success_total{model_name="x",finished_reason="stop"} 1.0\n'
    assert dashboard_queries.missing(set(refs[:1]), text, {"model_name": "m"}) == [
        "vllm:request_success_total: no sample has {'model_name': 'm'}"
    ]


class _Client:
    """What a Generation reads of its engine client when it applies deltas."""

    def __init__(self) -> None:
        self.metrics = ServerMetrics("m")

    def abort(self, request_id, sample_indices=None, *, stopped=False) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tp_engine.testing import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def _run_two_samples(tokenizer, monkeypatch):
    """One prompt, n = 2, on a fake clock (binary fractions: the sums are exact): arrival at
    100.0, both samples first scheduled on rank 0 at 100.25 (queue time 0.25 s); sample 0's
    tokens at 100.5, 100.75 and 101.0 ("length"), sample 1's one at 100.625 ("stop")."""
    from tp_engine.sampling_params import SamplingParams
    from tp_engine.server.api import generation
    from tp_engine.server.api.generation import Generation, PromptInput, StopOptions

    clock = [100.0]
    monkeypatch.setattr(generation.time, "monotonic", lambda: clock[0])
    client = _Client()
    gen = Generation(client, tokenizer, "r", [PromptInput([1, 2, 3])], lambda p: SamplingParams(),
                     2, StopOptions([], False, True, 0))  # fmt: skip
    first, second = gen.choices

    def apply(choice, tokens, at, finish=None, scheduled_at=None):
        clock[0] = at
        gen._apply(choice, Delta("r-0", choice.sample_index, tokens, finish, None, None, 0.25,
                                 None, None, None, scheduled_at))  # fmt: skip

    apply(first, [5], 100.5, scheduled_at=100.25)
    apply(second, [6], 100.625, "stop", scheduled_at=100.25)
    value = client.metrics.registry.get_sample_value
    # One sample is still running: the prompt's longest is not known yet.
    assert value("vllm:request_max_num_generation_tokens_count", {"model_name": "m"}) == 0
    apply(first, [7], 100.75)
    apply(first, [8], 101.0, "length")
    return client


def test_request_phases_follow_vllms_definitions(tokenizer, monkeypatch):
    value = _run_two_samples(tokenizer, monkeypatch).metrics.registry.get_sample_value
    m = {"model_name": "m"}
    # Prefill: first scheduled → first token (0.25 s and 0.375 s); decode: first → last token
    # (0.5 s and 0: one token); inference: first scheduled → last token (0.75 s and 0.375 s).
    for name, count, total in (
        ("vllm:request_prefill_time_seconds", 2, 0.625),
        ("vllm:request_decode_time_seconds", 2, 0.5),
        ("vllm:request_inference_time_seconds", 2, 1.125),
        ("vllm:request_queue_time_seconds", 2, 0.5),
    ):
        assert value(f"{name}_count", m) == count, name
        assert value(f"{name}_sum", m) == total, name
    # vLLM's request latency buckets: 0.25 s falls in le=0.3, 0.375 s in le=0.5.
    assert value("vllm:request_prefill_time_seconds_bucket", {**m, "le": "0.3"}) == 1
    assert value("vllm:request_prefill_time_seconds_bucket", {**m, "le": "0.5"}) == 2
    # The longest of the prompt's two samples (3 tokens, not 1), observed once.
    assert value("vllm:request_max_num_generation_tokens_count", m) == 1
    assert value("vllm:request_max_num_generation_tokens_sum", m) == 3
    assert value("vllm:request_generation_tokens_sum", m) == 4


def test_the_registry_serves_every_series_the_dashboard_reads(tokenizer, monkeypatch):
    client = _run_two_samples(tokenizer, monkeypatch)
    client.metrics.set_engine_stats(EngineStats(1, 0, 0.5, 100, 30, 0, host_kv_cache_usage=0.25))
    text = generate_latest(client.metrics.registry).decode()
    refs = dashboard_queries.references(dashboard_queries.load(DASHBOARD))
    assert dashboard_queries.missing(refs, text, {"model_name": "m"}) == []
    value = client.metrics.registry.get_sample_value
    assert value("vllm:num_requests_swapped", {"model_name": "m"}) == 0
    assert value("vllm:cpu_cache_usage_perc", {"model_name": "m"}) == 0.25
