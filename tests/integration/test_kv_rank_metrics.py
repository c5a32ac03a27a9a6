"""Per-rank KV transfer counters from real sim workers (real engines, NIXL agents or the
in-memory transport, one per rank) on a real NATS to the metrics collector: a worker reports
one entry per KV rank in its load snapshots, the reader's ranks' read bytes grow with a pull and
add up to the pull's, the collector exports them by worker, rank and op and shows each
worker's shape in /cluster."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from shared.bus import Bus
from shared.codec import Codec
from shared.config import BusConfig
from shared.schemas import LoadSnapshot
from tests.integration import test_metrics_collector as collector_fixtures
from tests.integration.kv_cluster import TRANSPORTS, Cluster, prompts, transport_cluster
from tests.integration.test_metrics_collector import DEADLINE_S, Collector, cluster, scrape
from tests.waiting import wait_for

collector = collector_fixtures.collector  # a collector on its real HTTP port, torn down after the test
TP2 = {"tensor_parallel": 2}


@pytest.fixture
async def nodes(bus: Bus, bus_config: BusConfig) -> AsyncIterator[Cluster]:
    async for workers in transport_cluster(bus, bus_config, "memory"):
        yield workers


@pytest.fixture(params=TRANSPORTS)
async def any_nodes(bus: Bus, bus_config: BusConfig, request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    async for workers in transport_cluster(bus, bus_config, request.param):
        yield workers


async def latest_loads(bus: Bus, bus_config: BusConfig) -> dict[str, LoadSnapshot]:
    """Every worker's latest load snapshot, kept up to date as they arrive."""
    latest: dict[str, LoadSnapshot] = {}
    codec: Codec[LoadSnapshot] = Codec(LoadSnapshot)

    async def on_load(msg) -> None:  # type: ignore[no-untyped-def]
        snapshot = codec.decode(msg.data)
        latest[snapshot.worker_id] = snapshot

    await bus.client.subscribe(bus_config.subjects.load_all, cb=on_load)
    await bus.client.flush()
    return latest


def read_bytes(snapshot: LoadSnapshot | None) -> list[int]:
    return [rank.reads.nbytes for rank in snapshot.kv_ranks] if snapshot else []


async def test_a_pull_grows_the_read_bytes_of_each_of_the_readers_ranks(
        any_nodes: Cluster, bus: Bus, bus_config: BusConfig) -> None:
    nodes = any_nodes
    latest = await latest_loads(bus, bus_config)
    await nodes.add("prefill", shape=TP2)
    await nodes.add("decode", shape=TP2)
    await wait_for(lambda: len(read_bytes(latest.get("decode"))) == 2, DEADLINE_S, "decode's two ranks reported")
    assert [rank.rank for rank in latest["decode"].kv_ranks] == [0, 1]
    assert read_bytes(latest["decode"]) == [0, 0]

    await nodes.disaggregated("prefill", "decode", prompts()[-1], 4)
    await wait_for(lambda: all(read_bytes(latest["decode"])), DEADLINE_S, "both ranks' reads in a load snapshot")
    [pull] = [record for record in nodes.records if record.kind == "pull"]
    ranks = latest["decode"].kv_ranks
    assert sum(rank.reads.nbytes for rank in ranks) == pull.bytes > 0
    for rank in ranks:
        assert rank.reads.transfers >= 1 and rank.reads.descriptors >= 1 and rank.reads.seconds > 0
        assert (rank.reads.failed, rank.reads.cancelled, rank.writes.transfers) == (0, 0, 0)
    # The holder's agents were read from: they moved nothing themselves.
    await wait_for(lambda: len(read_bytes(latest.get("prefill"))) == 2, DEADLINE_S, "prefill's ranks reported")
    assert all(rank.reads.transfers == rank.writes.transfers == 0 for rank in latest["prefill"].kv_ranks)
    await nodes.assert_clean()


async def test_the_collector_exports_each_rank_and_shows_each_shape(nodes: Cluster, collector: Collector) -> None:
    await nodes.add("prefill", shape=TP2)
    await nodes.add("decode", shape={"pipeline_parallel": 2, "block_size": 32})
    await nodes.disaggregated("prefill", "decode", prompts()[-1], 4)

    def read(samples: dict, worker: str, rank: int) -> float:  # type: ignore[type-arg]
        return samples.get(("tandem_kv_rank_transfer_bytes_total",
                            (("op", "read"), ("rank", str(rank)), ("worker", worker))), 0.0)

    async def exported() -> bool:
        samples = await scrape(collector)
        return read(samples, "decode", 0) > 0 and read(samples, "decode", 1) > 0

    await wait_for(exported, DEADLINE_S, "decode's two ranks' read bytes in /metrics")
    samples = await scrape(collector)
    for rank in (0, 1):
        decode = (("op", "read"), ("rank", str(rank)), ("worker", "decode"))
        assert samples["tandem_kv_rank_transfers_total", decode] >= 1
        assert samples["tandem_kv_rank_transfer_seconds_total", decode] > 0
        assert samples["tandem_kv_rank_transfer_descriptors_total", decode] >= 1
        assert samples["tandem_kv_rank_transfer_failures_total", (decode[0], ("outcome", "failed"), *decode[1:])] == 0
        assert read(samples, "prefill", rank) == 0
    workers = {worker["worker_id"]: worker for worker in (await cluster(collector))["workers"]}
    assert {worker_id: worker["shape"] for worker_id, worker in workers.items()} == {
        "prefill": "tp2 pp1 bs16", "decode": "tp1 pp2 bs32"}
    assert [rank["rank"] for rank in workers["decode"]["kv_ranks"]] == [0, 1]
    await nodes.assert_clean()
