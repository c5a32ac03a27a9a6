"""The router's Prometheus metrics, on a registry of its own per app (never the global one:
a test process builds several apps). Served at `/metrics` (`exposition(accept)`: the
OpenMetrics format, with exemplars, when the scraper asks for it).

Latency histograms are per role of the worker concerned (`prefill`, `decode`, `both`;
`unknown` for a worker already gone) and carry the request's trace id as an exemplar
(`trace_exemplar(span)`, made once per request by the caller): `observe_ttft`,
`record_tokens_between`, `observe_queue`, `observe_e2e`. Per-worker load gauges (reported
and predicted) are read from the worker pool at scrape time. The per-request and per-token
calls reach their labelled children through `Children` (no `labels()` per call).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.router.kv.index import IndexStats
from services.router.routing import WorkerView
from shared.codec import MalformedCounter
from shared.prometheus import Children, Exemplar, render

UNKNOWN_ROLE = "unknown"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Routing one request is pure computation over the candidates: microseconds to milliseconds.
_ROUTE_DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


class _MalformedCollector(Collector):
    def __init__(self, malformed: MalformedCounter) -> None:
        self._malformed = malformed

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("tandem_router_malformed_messages", "Bus messages dropped as malformed",
                                     labels=["subject"])
        for subject, count in sorted(self._malformed.by_subject.items()):
            family.add_metric([subject], count)
        yield family


class _KvIndexCollector(Collector):
    """What the KV index holds per worker, read at scrape time: a worker whose blocks never
    show up here (block size or salt mismatch) is one the router cannot route prefixes to."""

    def __init__(self) -> None:
        self.stats: Callable[[], IndexStats] | None = None  # set once the index exists

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self.stats is None:
            return
        stats = self.stats()
        blocks = GaugeMetricFamily("tandem_router_kv_index_blocks", "Blocks the KV index holds per worker, "
                                   "reported (kind=held) or predicted for requests just routed (kind=speculative)",
                                   labels=["worker", "kind"])
        for worker in stats.workers:
            blocks.add_metric([worker.worker_id, "held"], worker.blocks)
            blocks.add_metric([worker.worker_id, "speculative"], worker.speculative_blocks)
        yield blocks
        mismatched = CounterMetricFamily(
            "tandem_router_kv_hash_mismatch_blocks", "Blocks whose chain hash, as the worker sent it, differs "
            "from the one computed from their token ids (counted with --verify-kv-hashes only)", labels=["worker"])
        for worker in stats.workers:
            mismatched.add_metric([worker.worker_id], worker.mismatched_blocks)
        yield mismatched


class _WorkerLoadCollector(Collector):
    """Each worker's load as the router sees it, read at scrape time: last reported by the
    worker (running + waiting) and predicted (reported plus what was routed since)."""

    def __init__(self) -> None:
        self.views: Callable[[], list[WorkerView]] | None = None  # set once the pool exists

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self.views is None:
            return
        labels = ["worker", "role"]
        reported = GaugeMetricFamily("tandem_router_worker_reported_load_requests",
                                     "Running + waiting requests in the worker's last load report", labels=labels)
        predicted = GaugeMetricFamily("tandem_router_worker_predicted_load_requests",
                                      "Load the router predicts: the last report plus requests routed since",
                                      labels=labels)
        for view in self.views():
            if view.reported_load is not None:
                reported.add_metric([view.worker_id, view.role.value], view.reported_load)
            predicted.add_metric([view.worker_id, view.role.value], view.predicted_load)
        yield reported
        yield predicted


class RouterMetrics:
    def __init__(self, malformed: MalformedCounter) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._add_request_metrics()
        self._add_routing_metrics()
        self._add_flow_metrics()
        self._add_load_metrics()
        self._add_auth_metrics()
        self.registry.register(_MalformedCollector(malformed))
        self._kv_index = _KvIndexCollector()
        self.registry.register(self._kv_index)
        self._loads = _WorkerLoadCollector()
        self.registry.register(self._loads)
        self._roles: dict[str, str] = {}  # a worker's role never changes under its id
        self._requests, self._route_decisions = Children(self.requests), Children(self.route_decisions)
        self._ttft, self._itl, self._queue = Children(self.ttft), Children(self.itl), Children(self.queue)
        self._api_key_requests = Children(self.api_key_requests)
        # Label sets of rare events exist from the start at 0, so a rate over them is 0, not absent.
        for stage in ("before_first_token", "mid_stream"):
            for result in ("resumed", "failed"):
                self.resumes.labels(stage, result)
        for result in ("released", "already_ended", "unreachable"):
            self.lease_releases.labels(result)

    # Each group's metrics are created in the order of the exposition (the registry's order).

    def _add_request_metrics(self) -> None:
        """Requests by outcome, their latencies by role, and their tokens."""
        self.requests = Counter("tandem_router_requests", "Requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=self.registry)
        self.ttft = Histogram("tandem_router_time_to_first_token_seconds",
                              "Arrival to first token, by role of the worker that produced it",
                              ["role"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("tandem_router_inter_token_latency_seconds",
                             "Time between output tokens, by role of the worker that produced them",
                             ["role"], buckets=_ITL_BUCKETS, registry=self.registry)
        self.queue = Histogram("tandem_router_queue_time_seconds",
                               "Arrival until the router hands the request's first part to a worker "
                               "(routing and waiting for a worker), by role of that worker",
                               ["role"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("tandem_router_e2e_request_latency_seconds", "Arrival to last byte",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("tandem_router_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=self.registry)
        self.cached_tokens = Counter("tandem_router_cached_prompt_tokens",
                                     "Prompt tokens served from a prefix cache", registry=self.registry)
        self.completion_tokens = Counter("tandem_router_completion_tokens", "Generated tokens",
                                         registry=self.registry)

    def _add_routing_metrics(self) -> None:
        """The routing decisions: by flow and reason, and how long each took."""
        # flow "none": no worker was asked (reasons "overloaded": 429, "cache_threshold")
        self.route_decisions = Counter("tandem_router_route_decisions", "Routing decisions by flow and reason",
                                       ["flow", "reason"], registry=self.registry)
        self.route_decision_time = Histogram(
            "tandem_router_route_decision_seconds",
            "Time to route one request: the KV index lookup, the candidates' views, the policy's decision",
            buckets=_ROUTE_DECISION_BUCKETS, registry=self.registry)
        self.route_decision_cpu = Histogram(
            "tandem_router_route_decision_cpu_seconds",
            "CPU time of routing one request (the same work; without the time the process waited for a core)",
            buckets=_ROUTE_DECISION_BUCKETS, registry=self.registry)

    def _add_flow_metrics(self) -> None:
        """How requests' parts went between workers: resumes, prefix pulls, disaggregation,
        KV transfers and the leases released for readers that never came."""
        self.resumes = Counter(
            "tandem_router_resumes",
            "Requests re-routed after losing their worker, by stage (before_first_token, mid_stream) and result",
            ["stage", "result"], registry=self.registry)
        self.prefix_pulls_routed = Counter(
            "tandem_router_prefix_pulls", "Requests sent with another worker named to pull a cached prefix from",
            registry=self.registry)
        self.disaggregated_requests = Counter(
            "tandem_router_disaggregated_requests", "Requests served by a prefill and a decode worker (either KV transfer mode)",
            registry=self.registry)
        self.kv_transfer_modes = Counter(
            "tandem_router_kv_transfer_mode",
            "Disaggregated requests with a decode part, by how the prompt's KV reached it (pull, push)",
            ["mode"], registry=self.registry)
        self.kv_pulled_tokens = Counter("tandem_router_kv_pulled_tokens",
                                        "Prompt tokens whose KV a worker pulled from another worker",
                                        registry=self.registry)
        self.kv_recomputed_tokens = Counter("tandem_router_kv_recomputed_tokens",
                                            "Tokens whose KV was meant to arrive but had to be computed",
                                            registry=self.registry)
        self.lease_releases = Counter("tandem_router_kv_lease_releases",
                                      "KV leases the router released for readers that never came, by result",
                                      ["result"], registry=self.registry)

    def _add_load_metrics(self) -> None:
        """Requests in flight and the workers the router knows."""
        self.in_flight = Gauge("tandem_router_in_flight_requests", "Requests routed and not yet ended",
                               registry=self.registry)
        self.workers = Gauge("tandem_router_workers", "Workers in the membership mirror", registry=self.registry)
        self.admission_waiting = Gauge("tandem_router_admission_waiting_requests",
                                       "Requests waiting in the router's admission queue", registry=self.registry)
        self.held = Gauge("tandem_router_held_requests",
                          "Requests of scalable models waiting for a worker to start", registry=self.registry)

    def _add_auth_metrics(self) -> None:
        """API requests by key, and those refused for want of a valid key."""
        # One `key` label value per key in the key file: bounded by the file, never the key itself.
        self.api_key_requests = Counter("tandem_router_api_key_requests",
                                        "API requests by key name and outcome (accepted, rate_limited, "
                                        "concurrency_limited)", ["key", "outcome"], registry=self.registry)
        self.auth_rejected = Counter("tandem_router_auth_rejected_requests",
                                     "API requests refused with 401, by reason (missing_key, invalid_key)",
                                     ["reason"], registry=self.registry)

    def count_api_key(self, name: str, outcome: str) -> None:
        self._api_key_requests(name, outcome).inc()

    def count_auth_rejected(self, reason: str) -> None:
        self.auth_rejected.labels(reason).inc()

    def watch_workers(self, count: Callable[[], int]) -> None:
        self.workers.set_function(count)

    def watch_pool(self, views: Callable[[], list[WorkerView]]) -> None:
        """The pool's workers: their load gauges, and the roles latency histograms use."""
        self._loads.views = views

    def role_of(self, worker_id: str) -> str:
        role = self._roles.get(worker_id)
        if role is None and worker_id and self._loads.views is not None:
            for view in self._loads.views():
                self._roles[view.worker_id] = view.role.value
            role = self._roles.get(worker_id)
        return role or UNKNOWN_ROLE

    def count_request(self, endpoint: str, outcome: str) -> None:
        self._requests(endpoint, outcome).inc()

    def count_route(self, flow: str, reason: str) -> None:
        self._route_decisions(flow, reason).inc()

    def observe_ttft(self, worker_id: str, seconds: float, exemplar: Exemplar | None) -> None:
        self._ttft(self.role_of(worker_id)).observe(seconds, exemplar=exemplar)

    def observe_queue(self, worker_id: str, seconds: float, exemplar: Exemplar | None) -> None:
        self._queue(self.role_of(worker_id)).observe(max(0.0, seconds), exemplar=exemplar)

    def observe_e2e(self, seconds: float, exemplar: Exemplar | None) -> None:
        self.e2e.observe(seconds, exemplar=exemplar)

    def watch_kv_index(self, stats: Callable[[], IndexStats]) -> None:
        self._kv_index.stats = stats

    def record_tokens_between(self, gap_s: float, tokens: int, worker_id: str = "",
                              exemplar: Exemplar | None = None) -> None:
        """One observation per token: a frame of n tokens after `gap_s` is n gaps of gap_s/n."""
        if tokens <= 0:
            return
        per_token = gap_s / tokens
        itl = self._itl(self.role_of(worker_id))
        # The n observations fall in one bucket, whose exemplar is its latest: set it once.
        itl.observe(per_token, exemplar=exemplar)
        for _ in range(tokens - 1):
            itl.observe(per_token)

    def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        """The samples and their content type (OpenMetrics, with exemplars, if `accept` asks)."""
        return render(self.registry, accept)

