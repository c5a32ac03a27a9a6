"""Span helpers of the router's request flows: a child span per worker part of a request,
the W3C trace headers that carry a span's context to its worker, and ending a span once
with its outcome.

A span that records nothing (tracing off, or a trace not sampled) has children that would
record nothing either: `child_span` then hands back the parent itself, so a request pays
for one span (its HTTP span, whose trace id names it in logs, headers and exemplars) rather
than one per routing step and worker part. Workers see the same trace id either way.
"""

from __future__ import annotations

import asyncio

from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from shared.errors import ErrorCode, TandemError
from shared.tracing import span_context_headers

tracer = trace.get_tracer("tandem.router")


def records_nothing(span: trace.Span) -> bool:
    """A valid span of a trace not sampled: its children may share it. (Not `is_recording()`:
    a sampled span already ended records nothing more, but its children still do.)"""
    context = span.get_span_context()
    return context.is_valid and not context.trace_flags.sampled


def child_span(name: str, parent: trace.Span, worker_id: str | None = None,
               attributes: dict[str, AttributeValue] | None = None) -> trace.Span:
    """A span under `parent`, or `parent` itself where it records nothing."""
    if records_nothing(parent):
        return parent
    attributes = dict(attributes or {})
    if worker_id is not None:
        attributes["tandem.worker_id"] = worker_id
    return tracer.start_span(name, context=trace.set_span_in_context(parent), attributes=attributes)


def span_headers(span: trace.Span) -> dict[str, str]:
    return span_context_headers(span)


API_KEY_ATTRIBUTE = "tandem.api_key"  # the key's name from the key file, never the key


def name_api_key(name: str) -> None:
    """Name the API key on the current span (the request's HTTP span)."""
    trace.get_current_span().set_attribute(API_KEY_ATTRIBUTE, name)


def end_span(span: trace.Span | None, outcome: str) -> None:
    if span is not None and span.is_recording():  # not yet ended
        span.set_attribute("tandem.outcome", outcome)
        span.end()


def outcome_of(error: BaseException) -> str:
    """A failed request's outcome, for its span and its record: the error's code."""
    if isinstance(error, TandemError):
        return error.code.value
    if isinstance(error, asyncio.CancelledError):
        return ErrorCode.CANCELLED.value
    return ErrorCode.UNAVAILABLE.value
