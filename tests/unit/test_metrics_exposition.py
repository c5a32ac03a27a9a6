"""`/metrics` content negotiation and trace-id exemplars (`shared.prometheus`), and the
router's per-role latency histograms (`services.router.metrics`)."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry, Counter, Histogram

from services.metrics.exposition import TransferMetrics
from services.router.metrics import RouterMetrics
from services.router.routing import WorkerView
from shared.codec import MalformedCounter
from shared.prometheus import Children, headers_exemplar, render, trace_exemplar
from shared.schemas import TransferRecord, WorkerRole, WorkerStatus

PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"

tracer = TracerProvider().get_tracer("test")


def view(worker_id: str, role: WorkerRole, reported: int | None = 2) -> WorkerView:
    return WorkerView(worker_id=worker_id, model="m", role=role, status=WorkerStatus.ACTIVE, max_num_seqs=8,
                      max_model_len=512, reported_load=reported, in_flight=1, in_flight_at_report=0, last_routed=0,
                      compat_hash="h")


def test_render_negotiates_openmetrics_with_exemplars_and_text_without() -> None:
    registry = CollectorRegistry()
    histogram = Histogram("tandem_test_seconds", "t", buckets=(1.0,), registry=registry)
    histogram.observe(0.5, exemplar={"trace_id": TRACE_ID})
    text, text_type = render(registry, None)
    assert text_type.startswith("text/plain") and b"trace_id" not in text
    open_metrics, open_type = render(registry, PROMETHEUS_ACCEPT)
    assert open_type.startswith("application/openmetrics-text")
    assert f'tandem_test_seconds_bucket{{le="1.0"}} 1.0 # {{trace_id="{TRACE_ID}"}} 0.5'.encode() in open_metrics
    assert open_metrics.endswith(b"# EOF\n")


def test_trace_exemplar_is_the_span_trace_id() -> None:
    with tracer.start_as_current_span("request") as span:
        expected = {"trace_id": format(span.get_span_context().trace_id, "032x")}
        assert trace_exemplar() == expected
    assert trace_exemplar(span) == expected
    assert trace_exemplar() is None  # no current span


def test_children_are_the_metrics_own_looked_up_once() -> None:
    registry = CollectorRegistry()
    counter = Counter("things", "Things by kind", ["kind"], registry=registry)
    children = Children(counter)
    assert children("a") is children("a") is counter.labels("a")
    children("a").inc()
    children("b").inc(2)
    assert registry.get_sample_value("things_total", {"kind": "a"}) == 1
    assert registry.get_sample_value("things_total", {"kind": "b"}) == 2


def test_headers_exemplar_reads_traceparent() -> None:
    assert headers_exemplar({"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"}) == {"trace_id": TRACE_ID}
    for headers in (None, {}, {"traceparent": "junk"}, {"traceparent": f"00-{'0' * 32}-00f067aa0ba902b7-01"},
                    {"traceparent": f"00-{'z' * 32}-00f067aa0ba902b7-01"}):
        assert headers_exemplar(headers) is None


def test_router_latencies_are_per_role_with_exemplars() -> None:
    metrics = RouterMetrics(MalformedCounter())
    metrics.watch_pool(lambda: [view("p1", WorkerRole.PREFILL), view("d1", WorkerRole.DECODE, reported=None)])
    with tracer.start_as_current_span("request") as span:
        exemplar = trace_exemplar(span)
        metrics.observe_ttft("p1", 0.2, exemplar)
        metrics.record_tokens_between(0.02, 2, "d1", exemplar)
        metrics.observe_queue("p1", 0.001, exemplar)
        metrics.observe_ttft("gone", 0.3, exemplar)
    sample = metrics.registry.get_sample_value
    assert sample("tandem_router_time_to_first_token_seconds_count", {"role": "prefill"}) == 1
    assert sample("tandem_router_time_to_first_token_seconds_count", {"role": "unknown"}) == 1
    assert sample("tandem_router_inter_token_latency_seconds_count", {"role": "decode"}) == 2
    assert sample("tandem_router_queue_time_seconds_count", {"role": "prefill"}) == 1
    assert sample("tandem_router_worker_predicted_load_requests", {"worker": "d1", "role": "decode"}) == 1
    assert sample("tandem_router_worker_reported_load_requests", {"worker": "p1", "role": "prefill"}) == 2
    assert sample("tandem_router_worker_reported_load_requests", {"worker": "d1", "role": "decode"}) is None
    assert sample("tandem_router_resumes_total", {"stage": "mid_stream", "result": "resumed"}) == 0
    body, content_type = metrics.exposition(PROMETHEUS_ACCEPT)
    trace_id = format(span.get_span_context().trace_id, "032x")
    assert content_type.startswith("application/openmetrics-text")
    assert f'# {{trace_id="{trace_id}"}}'.encode() in body


def test_transfer_times_are_per_reader_role() -> None:
    registry = CollectorRegistry()
    transfers = TransferMetrics(registry, {"d1": "decode"}.get)
    for worker_id in ("d1", "gone"):
        transfers.observe(TransferRecord(worker_id=worker_id, request_id="r", kind="pull", peer_worker_id="p1",
                                         outcome="done", blocks=2, blocks_ok=2, bytes=64, duration_s=0.01,
                                         pulled_tokens=32, recomputed_tokens=0), {"trace_id": TRACE_ID})
    assert registry.get_sample_value("tandem_kv_transfer_seconds_count", {"kind": "pull", "role": "decode"}) == 1
    assert registry.get_sample_value("tandem_kv_transfer_seconds_count", {"kind": "pull", "role": "unknown"}) == 1
    body, _ = render(registry, PROMETHEUS_ACCEPT)
    assert f'# {{trace_id="{TRACE_ID}"}}'.encode() in body
