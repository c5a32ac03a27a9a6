"""Prometheus exposition shared by the router's and the metrics collector's `/metrics`.

- `render(registry, accept)`: the text format by default; the OpenMetrics format when the
  scraper's `Accept` header asks for it (Prometheus does). Only OpenMetrics carries
  exemplars, so a histogram observed with `trace_exemplar(...)` shows its trace ids there.
- `trace_exemplar(span)`: `{"trace_id": <32 hex>}` of a span (the current one by default),
  or None when there is no valid span context; pass it as `observe(..., exemplar=...)`.
- `headers_exemplar(headers)`: the same, from the W3C `traceparent` of a bus message.
- `Children(metric)`: a labelled metric's children, each looked up once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, TypeVar

from opentelemetry import trace
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics import MetricWrapperBase

Exemplar = dict[str, str]
Metric = TypeVar("Metric", bound=MetricWrapperBase)


class Children(Generic[Metric]):
    """A labelled metric's children by their label values, each looked up once: `labels()`
    checks its arguments and takes the metric's lock on every call, and the router's hot path
    asks for the same few children for every request and every token. (A child removed from
    the metric would stay here: the metrics this serves never remove one.)"""

    __slots__ = ("_metric", "_children")

    def __init__(self, metric: Metric) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], Metric] = {}

    def __call__(self, *values: str) -> Metric:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


def render(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """The registry's samples and their content type, as `accept` negotiates."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type


def trace_exemplar(span: trace.Span | None = None) -> Exemplar | None:
    context = (span if span is not None else trace.get_current_span()).get_span_context()
    if not context.is_valid:
        return None
    return {"trace_id": trace.format_trace_id(context.trace_id)}


def headers_exemplar(headers: Mapping[str, str] | None) -> Exemplar | None:
    """From `traceparent` ("00-<trace id>-<span id>-<flags>"); None if absent or malformed."""
    parts = (headers or {}).get("traceparent", "").split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or parts[1] == "0" * 32:
        return None
    try:
        int(parts[1], 16)
    except ValueError:
        return None
    return {"trace_id": parts[1]}
