"""The router's child spans: a trace not sampled pays for no span beyond the one it has."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from services.router.flows import spans
from services.router.flows.spans import child_span, records_nothing, span_headers

TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
SPAN_ID = 0xB7AD6B7169203331


def _span(sampled: bool) -> NonRecordingSpan:
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    return NonRecordingSpan(SpanContext(TRACE_ID, SPAN_ID, is_remote=False, trace_flags=flags))


def test_a_trace_not_sampled_shares_its_span_with_the_children() -> None:
    parent = _span(sampled=False)
    assert records_nothing(parent)
    assert child_span("router.route", parent) is parent
    assert child_span("router.decode", parent, "d1") is parent


def test_a_sampled_trace_gets_a_child_even_under_a_span_already_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spans, "tracer", TracerProvider(sampler=ParentBased(ALWAYS_ON)).get_tracer("test"))
    # A non-recording span with the sampled flag is what an ended span looks like to callers.
    parent = _span(sampled=True)
    assert not parent.is_recording() and not records_nothing(parent)
    child = child_span("router.decode", parent, "d1")
    assert child.is_recording() and child.get_span_context().trace_id == TRACE_ID
    assert child.get_span_context().span_id != SPAN_ID


def test_no_span_at_all_is_not_shared() -> None:
    assert not records_nothing(NonRecordingSpan(SpanContext(0, 0, is_remote=False)))


def test_the_headers_name_the_span_without_making_it_current() -> None:
    headers = span_headers(_span(sampled=False))
    assert headers == {"traceparent": f"00-{TRACE_ID:032x}-{SPAN_ID:016x}-00"}
