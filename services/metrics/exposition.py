"""Prometheus exposition of the cluster view, in a registry owned by one collector instance.

Per-worker gauges are produced at scrape time from `ClusterView.snapshot()` by a custom
collector, so a worker that leaves disappears from `/metrics` with no label bookkeeping; so
are the per-rank transfer counters of each worker's KV agents (`tandem_kv_rank_transfer_*`,
by worker, rank and op, from its load snapshot's `kv_ranks`).
Latencies are histograms observed as request records arrive; KV hand-off times are per
role of the reading worker and carry the hand-off's trace id as an exemplar when its
record came with a `traceparent` header. `render(registry, accept)` (from
`shared.prometheus`) serves the OpenMetrics format, with exemplars, to a scraper asking for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from services.metrics.cluster_view import ClusterView, Totals, WorkerView
from shared.codec import MalformedCounter
from shared.prometheus import Exemplar, render
from shared.schemas import RequestRecord, TransferRecord
from shared.schemas.load import TransferTotals

__all__ = ["ClusterCollector", "RequestHistograms", "TransferMetrics", "build_registry", "render"]
UNKNOWN_ROLE = "unknown"

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

_WORKER_GAUGES: tuple[tuple[str, str, Callable[[WorkerView], float | None]], ...] = (
    ("tandem_worker_kv_usage_ratio", "KV blocks referenced by live requests / total",
     lambda w: w.kv_usage),
    ("tandem_worker_waiting_requests", "Requests queued, not yet admitted", lambda w: w.waiting),
    ("tandem_worker_running_requests", "Requests in the running batch", lambda w: w.running),
    ("tandem_worker_prefix_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens",
     lambda w: w.prefix_hit_rate),
    ("tandem_worker_kv_stored_blocks", "Cached blocks announced on the KV event stream",
     lambda w: w.kv_stored_blocks),
    ("tandem_worker_pending_prefill_tokens", "Uncached prompt tokens not yet computed",
     lambda w: w.pending_prefill_tokens),
    ("tandem_worker_kv_synced", "1 while the collector's KV view of the worker is in sync",
     lambda w: float(w.kv_synced)),
    ("tandem_worker_kv_active_leases", "KV hand-offs the worker holds blocks for", lambda w: w.active_leases),
)
_WORKER_COUNTERS: tuple[tuple[str, str, Callable[[WorkerView], float]], ...] = (
    ("tandem_worker_prompt_tokens", "Prompt tokens processed (worker's cumulative counter)",
     lambda w: w.prompt_tokens_total),
    ("tandem_worker_cached_tokens", "Prompt tokens served from the prefix cache",
     lambda w: w.cached_tokens_total),
    ("tandem_worker_generated_tokens", "Tokens generated", lambda w: w.generated_tokens_total),
    ("tandem_worker_kv_event_gaps", "Sequence gaps seen on the worker's KV event stream",
     lambda w: w.kv_gaps),
    ("tandem_worker_kv_pulled_tokens", "Prompt tokens whose KV arrived from another worker",
     lambda w: w.kv_pulled_tokens_total),
    ("tandem_worker_kv_recomputed_tokens", "Tokens meant to arrive by transfer that were computed",
     lambda w: w.kv_recomputed_tokens_total),
    ("tandem_worker_kv_blocks_retried", "KV blocks read again after a failed transfer or verification",
     lambda w: w.kv_blocks_retried_total),
    ("tandem_worker_kv_blocks_recovered", "KV blocks that arrived and verified on a retry",
     lambda w: w.kv_blocks_recovered_total),
    ("tandem_worker_kv_blocks_recomputed", "KV blocks meant to arrive by transfer that were computed",
     lambda w: w.kv_blocks_recomputed_total),
    ("tandem_worker_computed_prompt_tokens", "Prompt tokens computed (not reused from cache, not received)",
     lambda w: w.computed_prompt_tokens_total),
    ("tandem_worker_external_prompt_tokens", "Prompt tokens the engine took from a KV transfer (engine's own count)",
     lambda w: w.external_prompt_tokens_total),
)
# Each KV rank's transport agent, one sample per worker, rank and op (read: the rank pulled,
# write: it pushed); bytes, seconds and descriptors of done transfers only.
_RANK_LABELS = ["worker", "rank", "op"]
_RANK_COUNTERS: tuple[tuple[str, str, Callable[[TransferTotals], float]], ...] = (
    ("tandem_kv_rank_transfer_bytes", "Bytes a KV rank's agent moved in transfers that completed",
     lambda t: t.nbytes),
    ("tandem_kv_rank_transfer_seconds", "Time a KV rank's agent spent in transfers that completed",
     lambda t: t.seconds),
    ("tandem_kv_rank_transfer_descriptors", "Descriptors (rows after merging adjacent ones) of completed transfers",
     lambda t: t.descriptors),
    ("tandem_kv_rank_transfers", "Transfers a KV rank's agent made, whatever their outcome", lambda t: t.transfers),
)
_ROLE_GAUGES: tuple[tuple[str, str, Callable[[Totals], float | None]], ...] = (
    ("tandem_role_workers", "Workers per role", lambda t: t.workers),
    ("tandem_role_kv_usage_ratio", "KV usage over all workers of the role", lambda t: t.kv_usage),
    ("tandem_role_waiting_requests", "Queued requests over the role", lambda t: t.waiting),
    ("tandem_role_running_requests", "Running requests over the role", lambda t: t.running),
)


class ClusterCollector(Collector):
    def __init__(self, view: ClusterView, malformed: Mapping[str, MalformedCounter]) -> None:
        self._view = view
        self._malformed = malformed

    def collect(self) -> Iterator[Metric]:
        snapshot = self._view.snapshot()
        workers = [([worker.worker_id, worker.role], worker) for worker in snapshot.workers]
        yield from _families(GaugeMetricFamily, _WORKER_GAUGES, ["worker", "role"], workers)
        yield from _families(CounterMetricFamily, _WORKER_COUNTERS, ["worker", "role"], workers)
        yield from _rank_families(snapshot.workers)
        yield from _families(GaugeMetricFamily, _ROLE_GAUGES, ["role"],
                             [([role], totals) for role, totals in snapshot.by_role.items()])
        cluster_hit_rate = GaugeMetricFamily(
            "tandem_cluster_prefix_hit_rate", "Cached / prompt tokens over all workers")
        _add(cluster_hit_rate, [], snapshot.totals.prefix_hit_rate)
        yield cluster_hit_rate
        yield _counter_by("tandem_requests", "Finished requests by outcome", "outcome",
                          snapshot.requests.by_outcome)
        yield _counter_by("tandem_metrics_malformed_messages", "Undecodable messages dropped by the collector",
                          "stream", {stream: counter.total for stream, counter in self._malformed.items()})


class RequestHistograms:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft = Histogram("tandem_request_ttft_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS_S, registry=registry)
        self.itl = Histogram("tandem_request_itl_seconds",
                             "Mean inter-token latency of each request (after the first token)",
                             buckets=_ITL_BUCKETS_S, registry=registry)
        self.duration = Histogram("tandem_request_duration_seconds", "End-to-end request time",
                                  buckets=_LATENCY_BUCKETS_S, registry=registry)

    def observe(self, record: RequestRecord) -> None:
        self.duration.observe(record.duration_s)
        if record.ttft_s is None:
            return
        self.ttft.observe(record.ttft_s)
        if record.completion_tokens > 1:
            self.itl.observe(max(0.0, record.duration_s - record.ttft_s) / (record.completion_tokens - 1))


_TRANSFER_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


class TransferMetrics:
    """KV hand-offs, from the readers' `TransferRecord`s; `role_of(worker_id)` names the
    reader's role (`unknown` for a worker not, or no longer, a member)."""

    def __init__(self, registry: CollectorRegistry, role_of: Callable[[str], str | None] = lambda _: None) -> None:
        self._role_of = role_of
        self.transfers = Counter("tandem_kv_transfers", "KV hand-offs by kind and outcome",
                                 ["kind", "outcome"], registry=registry)
        self.bytes = Counter("tandem_kv_transfer_bytes", "Bytes of KV moved", ["kind"], registry=registry)
        self.blocks = Counter("tandem_kv_transfer_blocks", "KV blocks asked for, by result", ["kind", "result"],
                              registry=registry)
        self.tokens = Counter("tandem_kv_transfer_tokens", "Prompt tokens pulled or recomputed after a failure",
                              ["kind", "source"], registry=registry)
        self.seconds = Histogram("tandem_kv_transfer_seconds", "Time of one hand-off, seen by the reader, "
                                 "by kind and the reader's role", ["kind", "role"], buckets=_TRANSFER_BUCKETS_S,
                                 registry=registry)

    def observe(self, record: TransferRecord, exemplar: Exemplar | None = None) -> None:
        self.transfers.labels(record.kind, record.outcome).inc()
        self.bytes.labels(record.kind).inc(record.bytes)
        self.blocks.labels(record.kind, "ok").inc(record.blocks_ok)
        self.blocks.labels(record.kind, "failed").inc(record.blocks - record.blocks_ok)
        self.tokens.labels(record.kind, "pulled").inc(record.pulled_tokens)
        self.tokens.labels(record.kind, "recomputed").inc(record.recomputed_tokens)
        role = self._role_of(record.worker_id) or UNKNOWN_ROLE
        self.seconds.labels(record.kind, role).observe(record.duration_s, exemplar=exemplar)


def build_registry(view: ClusterView, malformed: Mapping[str, MalformedCounter]
                   ) -> tuple[CollectorRegistry, RequestHistograms]:
    # A registry per collector instance: several collectors (or tests) in one process
    # never share or collide on metric names.
    registry = CollectorRegistry(auto_describe=True)
    registry.register(ClusterCollector(view, malformed))
    return registry, RequestHistograms(registry)


def _families(kind: type[GaugeMetricFamily] | type[CounterMetricFamily],
              table: Sequence[tuple[str, str, Callable[[Any], float | None]]], label_names: list[str],
              rows: Sequence[tuple[list[str], Any]]) -> Iterator[Metric]:
    """A family of `kind` per entry of `table` (name, documentation, value of a row), with a
    sample per row (its label values, the object the value is read from)."""
    for name, documentation, value in table:
        family = kind(name, documentation, labels=label_names)
        for labels, item in rows:
            _add(family, labels, value(item))
        yield family


def _counter_by(name: str, documentation: str, label: str, values: Mapping[str, float]) -> CounterMetricFamily:
    """A counter with one sample per key of `values`, labelled `label`."""
    family = CounterMetricFamily(name, documentation, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value)
    return family


def _rank_families(workers: Sequence[WorkerView]) -> Iterator[Metric]:
    rows = [([worker.worker_id, str(rank.rank), op], totals) for worker in workers for rank in worker.kv_ranks
            for op, totals in (("read", rank.reads), ("write", rank.writes))]
    yield from _families(CounterMetricFamily, _RANK_COUNTERS, _RANK_LABELS, rows)
    failures = CounterMetricFamily("tandem_kv_rank_transfer_failures",
                                   "Transfers a KV rank's agent did not complete, by outcome",
                                   labels=[*_RANK_LABELS, "outcome"])
    for labels, totals in rows:
        failures.add_metric([*labels, "failed"], totals.failed)
        failures.add_metric([*labels, "cancelled"], totals.cancelled)
    yield failures


def _add(family: GaugeMetricFamily | CounterMetricFamily, labels: list[str], value: float | None) -> None:
    # An undefined value (a hit rate before any prompt) is left out, not reported as 0.
    if value is not None:
        family.add_metric(labels, value)
