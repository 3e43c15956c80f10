"""What a Grafana dashboard's PromQL reads, and whether a `/metrics` scrape serves it.

`references(dashboard)` walks the JSON for every `expr` (panel targets, nested rows included)
and every templating query, and returns one `Reference` per series a query names: the series'
name as scraped (`vllm:e2e_request_latency_seconds_bucket`, `vllm:prompt_tokens_total`), the
labels it filters on with their values (`model_name="$model_name"`), and the labels an
aggregation around it groups by (`sum by(le)`, `sum by(finished_reason)`). A templating query
`label_values(model_name)` asks that some series carry the label.

`missing(refs, text, variables)` reads a scrape in Prometheus' text format and names each
reference that no sample satisfies: none by that name, none with the labels grouped by, or none
whose filtered labels hold the values asked (dashboard variables such as `$model_name`
substituted from `variables`). This is a subset of PromQL that vLLM's dashboard stays inside:
matchers `=` only are checked for values (`!=`, `=~`, `!~` for presence of the label).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# A series name (vLLM's all start with `vllm:`) and the matcher block after it, if any.
_SERIES = re.compile(r"(vllm:[A-Za-z0-9_:]+)\s*(\{[^}]*\})?")
_MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_LABEL_VALUES = re.compile(r"label_values\(\s*(?:([A-Za-z0-9_:]+)\s*,\s*)?([A-Za-z_]\w*)\s*\)")


@dataclass(frozen=True)
class Reference:
    series: str  # "" for `label_values(label)`: any series
    # Labels filtered on, each with its operator and value as the dashboard writes them.
    matchers: tuple[tuple[str, str, str], ...] = ()
    # Labels grouped by around it (`le` for histogram_quantile's buckets).
    grouped_by: frozenset[str] = field(default_factory=frozenset)

    @property
    def labels(self) -> frozenset[str]:
        return frozenset(name for name, _, _ in self.matchers) | self.grouped_by


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def queries(node: Any) -> list[str]:
    """Every PromQL text of a dashboard: targets' `expr` and templating queries."""
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                found.append(value)
            elif key == "query" and isinstance(value, str | dict):
                found.extend([value] if isinstance(value, str) else queries(value))
            else:
                found.extend(queries(value))
    elif isinstance(node, list):
        for item in node:
            found.extend(queries(item))
    return found


def parse(expr: str) -> list[Reference]:
    # A grouping names labels of the series it aggregates: vLLM's queries aggregate one
    # series each, so every grouping of an expression applies to each series in it.
    grouped = frozenset(
        label.strip() for group in _GROUPING.findall(expr) for label in group.split(",")
    ) - {""}
    refs = []
    for series, block in _SERIES.findall(expr):
        matchers = tuple(_MATCHER.findall(block or ""))
        # Only a histogram's buckets carry `le`; a `by(le)` never reaches its _sum or _count.
        by = grouped if series.endswith("_bucket") else grouped - {"le"}
        refs.append(Reference(series, matchers, by))
    for series, label in _LABEL_VALUES.findall(expr):
        refs.append(Reference(series, (), frozenset({label})))
    return refs


def references(dashboard: dict[str, Any]) -> set[Reference]:
    return {ref for expr in queries(dashboard) for ref in parse(expr)}


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a scrape in Prometheus' text format: (name, labels, value)."""
    return [
        (s.name, dict(s.labels), s.value) for family in text_string_to_metric_families(text)
        for s in family.samples
    ]  # fmt: skip


def total(text: str, name: str, **labels: str) -> float:
    """The sum of a series' samples in a scrape over the label sets that hold `labels`."""
    return sum(
        value for n, have, value in samples(text)
        if n == name and all(have.get(k) == v for k, v in labels.items())
    )  # fmt: skip


def missing(refs: set[Reference], text: str, variables: dict[str, str]) -> list[str]:
    """The references that no sample of the scrape `text` satisfies, each with the reason."""
    scraped = samples(text)
    problems = []
    for ref in sorted(refs, key=repr):
        named = [labels for name, labels, _ in scraped if not ref.series or name == ref.series]
        if not named:
            problems.append(f"{ref.series}: no such series")
            continue
        with_labels = [labels for labels in named if ref.labels <= labels.keys()]
        if not with_labels:
            problems.append(f"{ref.series or 'any series'}: no sample has {sorted(ref.labels)}")
            continue
        wanted = {
            name: _substitute(value, variables) for name, op, value in ref.matchers if op == "="
        }
        if not any(all(labels[k] == v for k, v in wanted.items()) for labels in with_labels):
            problems.append(f"{ref.series}: no sample has {wanted}")
    return problems


def _substitute(value: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)), value)
