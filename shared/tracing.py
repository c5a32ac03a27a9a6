"""OpenTelemetry set-up and W3C trace-context propagation through NATS headers.

A real SDK tracer provider is always installed, so trace ids exist and propagate; spans
are exported only when configured (`exporter="otlp"` or `"console"`), off by default.
"""

from __future__ import annotations

from typing import Literal

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

Exporter = Literal["none", "otlp", "console"]
_propagator = TraceContextTextMapPropagator()


def setup_tracing(service_name: str, exporter: Exporter = "none", otlp_endpoint: str = "") -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        kwargs = {"endpoint": otlp_endpoint} if otlp_endpoint else {}
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(**kwargs)))
    elif exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
    return provider


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Headers carrying the current span's context (`traceparent`, `tracestate`)."""
    carrier = dict(headers or {})
    _propagator.inject(carrier)
    return carrier


def extract_context(headers: dict[str, str] | None) -> otel_context.Context:
    return _propagator.extract(headers or {})
