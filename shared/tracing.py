"""OpenTelemetry set-up, W3C trace-context propagation through NATS headers, and the trace
id in log lines.

A real SDK tracer provider is always installed, so trace ids exist and propagate (NATS
headers, log lines, metric exemplars, the router's `x-trace-id`); spans are recorded and
exported only when configured (`exporter="otlp"` or `"console"`). Off (the default), the
provider samples nothing: a span is then a non-recording context with fresh ids, a few
microseconds, and attributes and events on it cost nothing. The batch processor's schedule follows
OpenTelemetry's own environment variables (`OTEL_BSP_SCHEDULE_DELAY`, in ms); whatever is
still buffered is exported when the process exits normally.

Called by every service's entry point (`setup_tracing`), by every sender of a NATS message
that belongs to a request (`inject_headers`), by every receiver of one (`extract_context`),
and by the CLI's logging set-up (`TraceLogFormatter`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Literal

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

Exporter = Literal["none", "otlp", "console"]
_propagator = TraceContextTextMapPropagator()
TRACE_ID_HEADER = "x-trace-id"  # the router's response header naming the request's trace


def setup_tracing(service_name: str, exporter: Exporter = "none", otlp_endpoint: str = "") -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                              sampler=ALWAYS_OFF if exporter == "none" else ParentBased(ALWAYS_ON))
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


def span_context_headers(span: trace.Span) -> dict[str, str]:
    """Headers carrying `span`'s context, without making it current."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    return _propagator.extract(dict(headers or {}))


def has_trace_context(headers: Mapping[str, str] | None) -> bool:
    """Whether a message carries a sender's trace context (then its handling gets a span)."""
    return headers is not None and "traceparent" in headers


def trace_id_hex(span: trace.Span | None = None) -> str:
    """The 32-hex-digit trace id of `span` (default: the current one); "" when there is none."""
    context = (span or trace.get_current_span()).get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else ""


def traceresponse(span: trace.Span) -> str:
    """The W3C `traceresponse` value naming `span`."""
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


class TraceLogFormatter(logging.Formatter):
    """Appends ` trace_id=<id>` to a record logged while a span is current."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        trace_id = trace_id_hex()
        return f"{line} trace_id={trace_id}" if trace_id else line
