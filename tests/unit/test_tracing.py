"""Trace context in NATS headers and the trace id in log lines (shared.tracing)."""

from __future__ import annotations

import logging

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from shared.tracing import TraceLogFormatter, extract_context, has_trace_context, inject_headers, trace_id_hex

tracer = TracerProvider().get_tracer("test")


def record(message: str) -> logging.LogRecord:
    return logging.LogRecord("tandem.test", logging.INFO, __file__, 1, message, (), None)


def test_log_lines_name_the_current_trace_and_only_then() -> None:
    formatter = TraceLogFormatter("%(levelname)s %(message)s")
    assert formatter.format(record("idle")) == "INFO idle"
    with tracer.start_as_current_span("request") as span:
        line = formatter.format(record("working"))
    assert line == f"INFO working trace_id={span.get_span_context().trace_id:032x}"


def test_headers_carry_the_current_span_to_the_receiver() -> None:
    assert inject_headers() == {} and not has_trace_context({}) and trace_id_hex() == ""
    with tracer.start_as_current_span("sender") as sender:
        headers = inject_headers({"other": "kept"})
    assert headers["other"] == "kept" and has_trace_context(headers)
    with tracer.start_as_current_span("receiver", context=extract_context(headers)) as receiver:
        assert trace_id_hex() == trace_id_hex(sender)
    assert receiver.parent is not None and receiver.parent.span_id == sender.get_span_context().span_id
    assert trace.get_current_span() is trace.INVALID_SPAN
