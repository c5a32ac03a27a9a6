"""Every Grafana dashboard panel's PromQL returns data from a real Prometheus scraping a real stack.

A local stack (sim engines: a prefill, a decode and a `both` worker, so that single and
disaggregated flows both happen) serves a bounded load through the official `openai`
client: completions and chat, streamed and not, a shared-prefix pair (prefix cache hits),
long prompts (prefill/decode hand-offs) and invalid requests (error counters). The
Debian package's Prometheus scrapes it with `observability/prometheus/prometheus.yml`,
its targets pointed at the stack's ports. Then every expression of every panel of every
dashboard, with Grafana's variables substituted as Grafana would, must return a non-empty
result through `/api/v1/query`: a panel naming a metric nobody exports fails here. The
router's latency histograms must also reach Prometheus with trace-id exemplars.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from launch.plan import WorkerSpec
from launch.stack import LocalStack
from shared.nats_server import EmbeddedNats, pid_alive
from shared.schemas import WorkerRole
from tests.e2e.conftest import make_stack
from tests.grafana_dashboards import (
    dashboard_variables,
    grafana_expr,
    local_prometheus_config,
    panel_queries,
    variable_lookups,
)
from tests.prometheus_server import PrometheusServer, prometheus_binary
from tests.stack_fixtures import running
from tests.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

WORKERS = (WorkerSpec(worker_id="p1", role=WorkerRole.PREFILL), WorkerSpec(worker_id="d1", role=WorkerRole.DECODE),
           WorkerSpec(worker_id="b1", role=WorkerRole.BOTH))
# Prompts of more than 32 uncached tokens go to a prefill/decode pair; shorter ones to one worker.
ROUTER_ARGS = ("--local-prefill-tokens", "32")
ROUNDS = 3
OK_REQUESTS = 'sum(tandem_router_requests_total{outcome="ok"})'
SHARED_PREFIX = "The quick brown fox jumps over the lazy dog while the cat watches. " * 4


@pytest.fixture(scope="module")
def observed_stack(nats_server: EmbeddedNats, tiny_model_dir: str,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    stack = make_stack(nats_server, tiny_model_dir, tmp_path_factory.mktemp("dashboards-stack"), workers=0,
                       specs=WORKERS, router_args=ROUTER_ARGS)
    with running(stack):
        yield stack


@pytest.fixture
def prometheus(observed_stack: LocalStack, tmp_path: Path) -> Iterator[PrometheusServer]:
    binary = prometheus_binary()
    targets = {"router": observed_stack.router_url.removeprefix("http://"),
               "metrics": observed_stack.metrics_url.removeprefix("http://")}
    with PrometheusServer(local_prometheus_config(targets), tmp_path, binary) as server:
        yield server
    assert not pid_alive(server.pid), "prometheus left behind"


async def serve_round(client: openai.AsyncOpenAI, model: str, number: int) -> int:
    """One round of the load; returns how many requests were answered (the invalid one is not)."""
    await client.completions.create(model=model, prompt=f"short {number}", max_tokens=4)
    await client.chat.completions.create(model=model, max_tokens=4,
                                         messages=[{"role": "user", "content": f"hello {number}"}])
    stream = await client.chat.completions.create(model=model, max_tokens=6, stream=True,
                                                  messages=[{"role": "user", "content": f"stream {number}"}])
    assert [chunk async for chunk in stream]
    stream = await client.completions.create(model=model, prompt=f"streamed {number}", max_tokens=6, stream=True)
    assert [chunk async for chunk in stream]
    long_prompt = " ".join(f"round{number} word{i}" for i in range(40))  # uncached: a prefill/decode pair
    await client.completions.create(model=model, prompt=long_prompt, max_tokens=6)
    for suffix in ("first", "second"):  # the second finds the first's prefix cached
        await client.completions.create(model=model, prompt=f"{SHARED_PREFIX} {number} {suffix}", max_tokens=6)
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=model, prompt="bad", max_tokens=-1)
    return 7


def value(prometheus: PrometheusServer, expr: str) -> float:
    result = prometheus.query(expr)
    return float(result[0]["value"][1]) if result else 0.0


async def test_every_dashboard_query_returns_data(observed_stack: LocalStack, prometheus: PrometheusServer,
                                                  openai_client) -> None:
    started = time.monotonic()
    await wait_for(prometheus.ready, timeout_s=20, what="prometheus ready")
    await wait_for(lambda: (targets := prometheus.targets()) != [] and all(t["health"] == "up" for t in targets),
                   timeout_s=20, what="every scrape target up")
    assert {t["labels"]["job"] for t in prometheus.targets()} == {"tandem-router", "tandem-metrics"}

    client = openai_client(observed_stack.router_url)
    model = (await client.models.list()).data[0].id
    answered = 0
    for number in range(ROUNDS):
        answered += await serve_round(client, model, number)
        # Each round lands in scrapes of its own, so rates over the load are not zero.
        await wait_for(lambda expected=answered: value(prometheus, OK_REQUESTS) >= expected, timeout_s=20,
                       what=f"round {number} scraped")
    # The load did what the dashboards show: both flows, KV hand-offs, prefix hits, errors.
    def load_visible() -> bool:
        flows = {r["metric"]["flow"] for r in prometheus.query("sum by (flow) (tandem_router_route_decisions_total)")}
        return ({"single", "disaggregated"} <= flows and value(prometheus, "sum(tandem_kv_transfer_bytes_total)") > 0
                and value(prometheus, "sum(tandem_router_cached_prompt_tokens_total)") > 0
                and value(prometheus, 'sum(tandem_router_requests_total{outcome!="ok"})') >= ROUNDS)

    await wait_for(load_visible, timeout_s=20, what="both flows, KV transfers, prefix hits and errors in prometheus")

    variables = dashboard_variables()
    queries = [(query, grafana_expr(query.expr, variables[query.dashboard])) for query in panel_queries()]
    assert len(queries) >= 20, "fewer panel queries than the dashboards have"
    empty: list[str] = []

    def every_query_has_data() -> bool:
        empty[:] = [f"{q.dashboard} / {q.panel} / {q.ref_id}: {expr}" for q, expr in queries
                    if not prometheus.query(expr)]
        return not empty

    try:
        await wait_for(every_query_has_data, timeout_s=15, what="data for every panel query")
    except AssertionError:
        raise AssertionError("panel queries without data:\n" + "\n".join(empty)) from None

    # Grafana's `label_values(metric, label)` variables: each finds values.
    for name, metric, label in variable_lookups():
        assert prometheus.label_values(label, metric), f"{name}: no values for label_values({metric}, {label})"

    exemplars = prometheus.exemplars("tandem_router_time_to_first_token_seconds_bucket")
    trace_ids = [e["labels"].get("trace_id", "") for series in exemplars for e in series["exemplars"]]
    assert trace_ids and all(len(trace_id) == 32 for trace_id in trace_ids), exemplars
    assert time.monotonic() - started < 90, "the dashboard check took too long"

