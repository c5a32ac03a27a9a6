"""The collector's live cluster page and the `/cluster` view it reads, over the real HTTP
port of a collector on a real nats-server: the page's files are served from the package,
and request records, transfer records and departures reach the view's recent activity."""

from __future__ import annotations

import pytest
from nats.js.kv import KeyValue

from shared.bus import Bus
from shared.codec import encode
from shared.config import BusConfig
from shared.schemas import RequestRecord, TransferRecord, WorkerRole
from tests.integration import test_metrics_collector as collector_fixtures
from tests.integration.test_metrics_collector import DEADLINE_S, Collector, cluster, register
from tests.waiting import wait_for

collector = collector_fixtures.collector  # a collector on its real HTTP port, torn down after the test
members = collector_fixtures.members


async def test_page_and_its_files_are_served(collector: Collector) -> None:
    root = await collector.http.get("/")
    assert root.status_code in (302, 307) and root.headers["location"] == "/cluster/page"
    page = await collector.http.get("/cluster/page")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for asset in ('src="/cluster/page/cluster.js"', 'href="/cluster/page/cluster.css"', 'rel="icon"'):
        assert asset in page.text
    script = await collector.http.get("/cluster/page/cluster.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert "innerHTML" not in script.text  # strings from the network go in as text nodes only
    style = await collector.http.get("/cluster/page/cluster.css")
    assert style.status_code == 200 and style.headers["content-type"].startswith("text/css")
    for missing in ("/cluster/page/nothing.js", "/cluster/page/..%2Fhttp_api.py"):
        assert (await collector.http.get(missing)).status_code == 404


async def test_cluster_view_carries_the_recent_activity(
        collector: Collector, members: KeyValue, bus: Bus, bus_config: BusConfig) -> None:
    subjects = bus_config.subjects
    await register(members, collector, "p1", WorkerRole.PREFILL)
    await register(members, collector, "d1", WorkerRole.DECODE)
    for outcome in ("ok", "ok", "unavailable"):
        await bus.client.publish(subjects.request_events, encode(RequestRecord(
            request_id=f"r-{outcome}", model="tiny", worker_id="d1", outcome=outcome, finish_reason=None,
            prompt_tokens=8, cached_tokens=0, completion_tokens=2, ttft_s=0.1, duration_s=0.2)))
    await bus.client.publish(subjects.kv_transfers("d1"), encode(TransferRecord(
        worker_id="d1", request_id="r-ok", kind="pull", peer_worker_id="p1", outcome="expired", blocks=2,
        blocks_ok=0, bytes=0, duration_s=0.5, pulled_tokens=0, recomputed_tokens=8, reason="lease expired")))

    async def arrived() -> bool:
        activity = (await cluster(collector))["activity"]
        return len(activity["recent_requests"]) == 3 and activity["transfers_by_outcome"] == {"expired": 1}

    await wait_for(arrived, DEADLINE_S, "the requests and the transfer in the activity")
    view = await cluster(collector)
    assert [(group["role"], group["worker_ids"]) for group in view["roles"]] == [("prefill", ["p1"]),
                                                                                ("decode", ["d1"])]
    activity = view["activity"]
    assert activity["requests_by_worker"] == {"d1": 3}
    assert activity["workers"]["d1"]["requests_per_s"] == pytest.approx(3 / activity["window_s"])
    assert activity["workers"]["p1"]["transfers_out_per_s"] == pytest.approx(1 / activity["window_s"])
    assert [(error["kind"], error["code"]) for error in activity["recent_errors"]] == [
        ("transfer", "expired"), ("request", "unavailable")]
    assert view["workers"][0]["engine"] == "sim" and view["workers"][0]["compat_hash"] == "c"

    await members.delete("p1")  # deregistered while active: shown as gone
    await wait_for(lambda: collector.service.view.worker_ids == ["d1"], DEADLINE_S, "the collector to drop p1")
    departed = (await cluster(collector))["activity"]["departed"]
    assert [(gone["worker_id"], gone["role"]) for gone in departed] == [("p1", "prefill")]
