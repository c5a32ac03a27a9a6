"""The router's HTTP span: one per API request, the root of the request's trace in Tandem.

`TraceMiddleware` (pure ASGI, installed by `services.router.http.app.create_app`) continues a
client's incoming W3C `traceparent` (else starts a new trace), makes the span current for
the whole exchange (the dispatcher's `router.generate` and everything after it are its
descendants), names the trace in the response headers (`x-trace-id`, and W3C
`traceresponse`), and ends the span once the last byte of the body, streamed or not, was
sent. Paths outside the API (health, metrics) get no span.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from shared.tracing import TRACE_ID_HEADER, extract_context, trace_id_hex, traceresponse

tracer = trace.get_tracer("tandem.router")
TRACED_PREFIX = "/v1/"


class TraceMiddleware:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(TRACED_PREFIX):
            await self.app(scope, receive, send)
            return
        incoming = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]
                    if name in (b"traceparent", b"tracestate")}
        method, path = scope["method"], scope["path"]
        span = tracer.start_span(f"{method} {path}", context=extract_context(incoming) if incoming else None,
                                 kind=SpanKind.SERVER, attributes={"http.request.method": method, "url.path": path})
        with trace.use_span(span, end_on_exit=True):
            trace_id = trace_id_hex(span)  # "" only where no tracer provider was set up (library use)
            trace_headers = [(TRACE_ID_HEADER.encode(), trace_id.encode()),
                             (b"traceresponse", traceresponse(span).encode())] if trace_id else []

            async def send_traced(message) -> None:
                if message["type"] == "http.response.start":
                    status = message["status"]
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                    message = {**message, "headers": [*message.get("headers", []), *trace_headers]}
                await send(message)

            await self.app(scope, receive, send_traced)
