"""Span helpers of the router's request flows: a child span per worker part of a request,
the W3C trace headers that carry a span's context to its worker, and ending a span once
with its outcome."""

from __future__ import annotations

from opentelemetry import trace

from shared.tracing import inject_headers

tracer = trace.get_tracer("tandem.router")


def child_span(name: str, parent: trace.Span, worker_id: str) -> trace.Span:
    return tracer.start_span(name, context=trace.set_span_in_context(parent),
                             attributes={"tandem.worker_id": worker_id})


def span_headers(span: trace.Span) -> dict[str, str]:
    with trace.use_span(span, end_on_exit=False):
        return inject_headers()


API_KEY_ATTRIBUTE = "tandem.api_key"  # the key's name from the key file, never the key


def name_api_key(name: str) -> None:
    """Name the API key on the current span (the request's HTTP span)."""
    trace.get_current_span().set_attribute(API_KEY_ATTRIBUTE, name)


def end_span(span: trace.Span | None, outcome: str) -> None:
    if span is not None and span.is_recording():  # not yet ended
        span.set_attribute("tandem.outcome", outcome)
        span.end()
