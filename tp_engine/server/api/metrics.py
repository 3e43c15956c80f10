"""Prometheus metrics at /metrics, with vLLM's names and labels, so its dashboards work as-is.

Two sources, one registry in the API process:

- rank 0's gauges and cumulative counters (running / waiting requests, KV-cache usage, prefix
  cache queries and hits, preemptions) arrive in every `EngineOutputs` as `EngineStats`; the
  counters are advanced by the difference to the previous totals;
- per-request latencies and token counts are measured here, where the tokens reach the client.

A request's phases, as vLLM's `IterationStats.update_from_finished_request` splits them: queue
time (arrival on rank 0 → first scheduled, timed on rank 0), prefill time (first scheduled →
first token), decode time (first → last token), inference time (first scheduled → last token).
The first scheduling's instant comes from rank 0 (`Delta.scheduled_at`) and the tokens' from
this process's arrival of them, one CLOCK_MONOTONIC for both, so prefill time ends where TTFT
does. A preemption moves none of the instants (vLLM's do not move either).

Every series carries `model_name` (the served model name), as vLLM's do; `examples/
prometheus_grafana` is vLLM's own dashboard, and `tests/test_grafana_dashboard.py` checks that
every series its queries read is here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tp_engine.server.messages import EngineStats

# vLLM's buckets (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                            40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


@dataclass(frozen=True)
class RequestTimes:
    """A sequence's instants on CLOCK_MONOTONIC (`time.monotonic()` in either process): its
    first scheduling on rank 0, its first and last tokens' arrival here. None: never came."""

    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        # vLLM exports no `*_created` series either (they double the output for no use).
        prometheus_client.disable_created_metrics()
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use.")
        # The pre-v1 name of the same gauge, still read by many dashboards.
        self.gpu_cache_usage = gauge("vllm:gpu_cache_usage_perc", "Same as kv_cache_usage_perc.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the cache.")
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries",
            "Prompt tokens looked up below the GPU's cache (the host-memory KV tier).",
        )
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits", "Prompt tokens found below the GPU's cache."
        )
        self.prompt_computed = counter(
            "tp_engine:prompt_tokens_computed",
            "Prompt tokens computed by forward passes here (not found in a cache, not received "
            "from a prefill server).",
        )
        self.host_kv_usage = gauge(
            "tp_engine:host_kv_cache_usage_perc", "Fraction of the host KV tier's blocks in use."
        )
        # vLLM v0's names, still read by its dashboard's "Scheduler State" and "Cache
        # Utilization" panels. Nothing swaps a request out here (a preempted one waits and
        # recomputes), so none is ever swapped; the CPU cache is the host tier (0 without one).
        self.num_swapped = gauge("vllm:num_requests_swapped", "Requests swapped out (always 0).")
        self.cpu_cache_usage = gauge(
            "vllm:cpu_cache_usage_perc", "Fraction of the host KV tier's blocks in use."
        )
        self.preemptions = counter("vllm:num_preemptions", "Sequences preempted for KV space.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self._success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Time between tokens.", _ITL_BUCKETS
        )
        self.tpot = histogram(
            "vllm:time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            _ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Arrival to last token.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Time waiting on rank 0 before first scheduled.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "First scheduled to first token (PREFILL phase).",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "First token to last token (DECODE phase).",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "First scheduled to last token (RUNNING phase).",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS
        )
        self.max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Most tokens generated by one of a prompt's n samples, once all have finished.",
            _TOKEN_BUCKETS,
        )
        # Speculative decoding (present when it is on; zero otherwise), vLLM's names.
        self.spec_drafts = counter(
            "vllm:spec_decode_num_drafts", "Verify steps of a sequence that carried drafts."
        )
        self.spec_draft_tokens = counter(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed."
        )
        self.spec_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted."
        )
        self._spec_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by draft position.",
            ["model_name", "position"],
            registry=r,
        )
        # vLLM's: one sample per state of the adapters, its value the time it was last seen.
        self._lora_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=r,
        )
        self._model_name = model_name
        self._last: EngineStats | None = None

    @property
    def last_engine_stats(self) -> EngineStats | None:
        """Rank 0's latest stats (None before the first outputs)."""
        return self._last

    def set_engine_stats(self, stats: EngineStats) -> None:
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.gpu_cache_usage.set(stats.kv_cache_usage)
        self.host_kv_usage.set(stats.host_kv_cache_usage)
        self.cpu_cache_usage.set(stats.host_kv_cache_usage)
        if stats.max_lora:
            self._lora_info.labels(
                str(stats.max_lora),
                ",".join(stats.waiting_lora_adapters),
                ",".join(stats.running_lora_adapters),
            ).set(time.time())
        last = self._last
        for counter, now, before in (
            (self.prefix_queries, stats.prefix_cache_queries, last and last.prefix_cache_queries),
            (self.prefix_hits, stats.prefix_cache_hits, last and last.prefix_cache_hits),
            (
                self.external_queries,
                stats.external_prefix_cache_queries,
                last and last.external_prefix_cache_queries,
            ),
            (
                self.external_hits,
                stats.external_prefix_cache_hits,
                last and last.external_prefix_cache_hits,
            ),
            (self.preemptions, stats.num_preemptions, last and last.num_preemptions),
            (
                self.prompt_computed,
                stats.prompt_tokens_computed,
                last and last.prompt_tokens_computed,
            ),
            (self.spec_drafts, stats.spec_num_drafts, last and last.spec_num_drafts),
            (
                self.spec_draft_tokens,
                stats.spec_num_draft_tokens,
                last and last.spec_num_draft_tokens,
            ),
            (
                self.spec_accepted_tokens,
                stats.spec_num_accepted_tokens,
                last and last.spec_num_accepted_tokens,
            ),
        ):
            if now > (before or 0):
                counter.inc(now - (before or 0))
        previous = last.spec_accepted_per_pos if last else []
        for position, now in enumerate(stats.spec_accepted_per_pos):
            before = previous[position] if position < len(previous) else 0
            if now > before:
                self._spec_per_pos.labels(self._model_name, str(position)).inc(now - before)
        self._last = stats

    def request_finished(
        self,
        finish_reason: str,
        *,
        num_prompt_tokens: int,
        num_generated_tokens: int,
        e2e_s: float,
        queue_time_s: float | None,
        times: RequestTimes,
    ) -> None:
        """One sequence is over."""
        self._success.labels(self._model_name, finish_reason).inc()
        self.e2e.observe(e2e_s)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generated_tokens)
        if queue_time_s is not None:
            self.queue_time.observe(queue_time_s)
        first, last, scheduled = times.first_token_at, times.last_token_at, times.scheduled_at
        if first is None or last is None:
            return  # no token: no prefill, decode or inference phase (vLLM observes none)
        decode_s = last - first
        self.decode_time.observe(decode_s)
        if num_generated_tokens > 1:
            self.tpot.observe(decode_s / (num_generated_tokens - 1))
        if scheduled is not None:
            # Never negative: rank 0 schedules before the API process reads the token.
            self.prefill_time.observe(max(0.0, first - scheduled))
            self.inference_time.observe(max(0.0, last - scheduled))

    def samples_finished(self, num_generated_tokens: list[int]) -> None:
        """Every sample of one prompt is over (n of them; a pooled prompt is one that generated
        nothing): vLLM's "max generation tokens in sequence group" is the longest one."""
        self.max_generation_tokens.observe(max(num_generated_tokens, default=0))
