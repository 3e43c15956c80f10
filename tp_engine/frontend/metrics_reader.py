"""`LLM.get_metrics()`: the engine's metrics as a list of objects, in the shape of vLLM's
`vllm.v1.metrics.reader` (each with a `name` in vLLM's Prometheus naming and its `labels`; a
counter or gauge has a `value`, a vector of counters `values`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tp_engine.core.outputs import EngineStats


@dataclass(frozen=True)
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Counter(Metric):
    value: int = 0


@dataclass(frozen=True)
class Gauge(Metric):
    value: float = 0.0


@dataclass(frozen=True)
class Vector(Metric):
    """Counters indexed by position (vLLM's per-position acceptance counts)."""

    values: list[int] = field(default_factory=list)


def engine_metrics(stats: EngineStats, labels: dict[str, str]) -> list[Metric]:
    return [
        Gauge("vllm:num_requests_running", labels, stats.num_running),
        Gauge("vllm:num_requests_waiting", labels, stats.num_waiting),
        Gauge("vllm:kv_cache_usage_perc", labels, stats.kv_cache_usage),
        Counter("vllm:prefix_cache_queries", labels, stats.prefix_cache_queries),
        Counter("vllm:prefix_cache_hits", labels, stats.prefix_cache_hits),
        Counter("vllm:external_prefix_cache_queries", labels, stats.external_prefix_cache_queries),
        Counter("vllm:external_prefix_cache_hits", labels, stats.external_prefix_cache_hits),
        Gauge("tp_engine:host_kv_cache_usage_perc", labels, stats.host_kv_cache_usage),
        Counter("vllm:num_preemptions", labels, stats.num_preemptions),
        Counter("vllm:spec_decode_num_drafts", labels, stats.spec_num_drafts),
        Counter("vllm:spec_decode_num_draft_tokens", labels, stats.spec_num_draft_tokens),
        Counter("vllm:spec_decode_num_accepted_tokens", labels, stats.spec_num_accepted_tokens),
        Vector(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            labels,
            list(stats.spec_accepted_per_pos),
        ),
    ]
