"""The metrics collector against a real nats-server, read over its real HTTP port."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest
from nats.js.kv import KeyValue
from prometheus_client.parser import text_string_to_metric_families

from services.metrics.config import MetricsConfig
from services.metrics.http_api import HttpServer, build_app
from services.metrics.main import run_metrics
from services.metrics.service import MetricsService
from shared.bus import Bus, connect
from shared.codec import Codec, encode
from shared.config import BusConfig
from shared.schemas import (
    AllBlocksCleared,
    BlockStored,
    ControlMessage,
    KvEventBatch,
    KvSnapshotRequest,
    LoadSnapshot,
    RequestRecord,
    WorkerCapacity,
    WorkerRegistration,
    WorkerRole,
)
from tests.waiting import wait_for

DEADLINE_S = 5.0
control_codec: Codec[ControlMessage] = Codec(ControlMessage)


class Collector(msgspec.Struct):
    service: MetricsService
    http: httpx.AsyncClient


@pytest.fixture
async def collector(bus_config: BusConfig) -> AsyncIterator[Collector]:
    config = MetricsConfig(port=0, bus=bus_config)
    service_bus = await connect(bus_config.nats_url, "test-metrics")
    service = MetricsService(config, service_bus)
    server = HttpServer(build_app(service.view, service.registry, lambda: service.bus_connected),
                        config.host, config.port)
    await service.start()
    await server.start()
    async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE_S) as client:
        yield Collector(service, client)
    await server.stop()
    await service.stop()
    await service_bus.close()


@pytest.fixture
async def members(bus: Bus, bus_config: BusConfig) -> KeyValue:
    return await bus.key_value(bus_config.subjects.members_bucket)


async def register(members: KeyValue, collector: Collector, worker_id: str,
                   role: WorkerRole = WorkerRole.DECODE) -> None:
    now = time.time()
    await members.put(worker_id, encode(WorkerRegistration(
        worker_id=worker_id, role=role, model="tiny", engine="sim", block_size=4, compat_hash="c",
        capacity=WorkerCapacity(kv_blocks=100, max_num_seqs=8, max_model_len=2048),
        started_at=now, heartbeat_at=now)))
    await wait_for(lambda: worker_id in collector.service.view.worker_ids, DEADLINE_S,
                   f"the collector to see {worker_id}")


async def cluster(collector: Collector) -> dict[str, Any]:
    response = await collector.http.get("/cluster")
    assert response.status_code == 200
    return response.json()


async def scrape(collector: Collector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics parsed into {(sample name, sorted labels): value}."""
    response = await collector.http.get("/metrics")
    assert response.status_code == 200
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


def load(worker_id: str, seq: int = 1, **fields: int) -> LoadSnapshot:
    values = dict(running=2, waiting=3, kv_total_blocks=100, kv_used_blocks=40, kv_cached_blocks=50,
                  prompt_tokens_total=400, cached_tokens_total=100, generated_tokens_total=20,
                  pending_prefill_tokens=0) | fields
    return LoadSnapshot(worker_id=worker_id, seq=seq, ts=time.time(), **values)


def kv_batch(worker_id: str, seq: int, *events) -> KvEventBatch:  # type: ignore[no-untyped-def]
    return KvEventBatch(worker_id=worker_id, seq=seq, ts=time.time(), events=list(events))


def stored(*hashes: int) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None,
                       token_ids=[1] * 4 * len(hashes), block_size=4)


async def test_events_show_in_cluster_and_metrics(
        collector: Collector, members: KeyValue, bus: Bus, bus_config: BusConfig) -> None:
    subjects = bus_config.subjects
    await register(members, collector, "w1", WorkerRole.PREFILL)
    await bus.client.publish(subjects.load("w1"), encode(load(
        "w1", kv_blocks_retried_total=5, kv_blocks_recovered_total=4, kv_blocks_recomputed_total=1)))
    await bus.client.publish(subjects.kv_events("w1"),
                             encode(kv_batch("w1", 0, AllBlocksCleared(), stored(1, 2, 3))))
    await bus.client.publish(subjects.request_events, encode(RequestRecord(
        request_id="r1", model="tiny", worker_id="w1", outcome="ok", finish_reason="length",
        prompt_tokens=8, cached_tokens=4, completion_tokens=5, ttft_s=0.2, duration_s=0.6)))

    async def all_arrived() -> bool:
        view = await cluster(collector)
        return bool(view["workers"]) and view["workers"][0]["load_seq"] == 1 \
            and view["workers"][0]["kv_stored_blocks"] == 3 and view["requests"]["by_outcome"] == {"ok": 1}

    await wait_for(all_arrived, DEADLINE_S, "the load, KV events and request record in /cluster")
    worker = (await cluster(collector))["workers"][0]
    assert (worker["worker_id"], worker["role"], worker["running"], worker["waiting"]) == ("w1", "prefill", 2, 3)
    assert worker["kv_usage"] == pytest.approx(0.4)
    assert worker["prefix_hit_rate"] == pytest.approx(0.25)
    assert worker["kv_synced"] is True

    samples = await scrape(collector)
    w1 = (("role", "prefill"), ("worker", "w1"))
    assert samples["tandem_worker_kv_usage_ratio", w1] == pytest.approx(0.4)
    assert samples["tandem_worker_waiting_requests", w1] == 3
    assert samples["tandem_worker_running_requests", w1] == 2
    assert samples["tandem_worker_prefix_hit_rate", w1] == pytest.approx(0.25)
    assert samples["tandem_worker_cached_tokens_total", w1] == 100
    assert [samples[f"tandem_worker_kv_blocks_{name}_total", w1] for name in ("retried", "recovered", "recomputed")
            ] == [5, 4, 1]
    assert samples["tandem_requests_total", (("outcome", "ok"),)] == 1
    assert samples["tandem_request_ttft_seconds_count", ()] == 1
    assert samples["tandem_request_ttft_seconds_bucket", (("le", "0.25"),)] == 1
    assert samples["tandem_request_ttft_seconds_bucket", (("le", "0.1"),)] == 0
    # Mean inter-token latency: (0.6 s - 0.2 s) over the 4 tokens after the first.
    assert samples["tandem_request_itl_seconds_sum", ()] == pytest.approx(0.1)

    # The worker leaves the bucket: it leaves the view and the exposition with it.
    await members.delete("w1")
    await wait_for(lambda: collector.service.view.worker_ids == [], DEADLINE_S, "the collector to drop every worker")
    assert not [key for key in await scrape(collector) if ("worker", "w1") in key[1]]


async def test_kv_gap_requests_a_snapshot(
        collector: Collector, members: KeyValue, bus: Bus, bus_config: BusConfig) -> None:
    subjects = bus_config.subjects
    await register(members, collector, "w2")
    control: asyncio.Queue[ControlMessage] = asyncio.Queue()

    async def on_control(msg) -> None:  # type: ignore[no-untyped-def]
        control.put_nowait(control_codec.decode(msg.data))

    subscription = await bus.client.subscribe(subjects.control("w2", "kv_snapshot"), cb=on_control)
    await bus.client.flush()
    try:
        await bus.client.publish(subjects.kv_events("w2"), encode(kv_batch("w2", 0, AllBlocksCleared())))
        await bus.client.publish(subjects.kv_events("w2"), encode(kv_batch("w2", 1, stored(7))))
        await bus.client.publish(subjects.kv_events("w2"), encode(kv_batch("w2", 4, stored(8))))
        message = await asyncio.wait_for(control.get(), DEADLINE_S)
        assert isinstance(message, KvSnapshotRequest)
        assert collector.service.snapshot_requests_sent == 1
        worker = (await cluster(collector))["workers"][0]
        assert (worker["kv_gaps"], worker["kv_synced"]) == (1, False)
        samples = await scrape(collector)
        assert samples["tandem_worker_kv_event_gaps_total", (("role", "decode"), ("worker", "w2"))] == 1
    finally:
        await subscription.unsubscribe()


async def test_malformed_messages_are_counted_and_dropped(
        collector: Collector, members: KeyValue, bus: Bus, bus_config: BusConfig) -> None:
    subjects = bus_config.subjects
    await register(members, collector, "w3")
    await bus.client.publish(subjects.load("w3"), b"\xc1 garbage")
    await bus.client.publish(subjects.kv_events("w3"), encode(load("w3")))  # wrong stream's schema
    await bus.client.publish(subjects.load("w3"), encode(load("w3", seq=9, running=6)))

    async def load_applied() -> bool:
        workers = (await cluster(collector))["workers"]
        return bool(workers) and workers[0]["running"] == 6

    await wait_for(load_applied, DEADLINE_S, "w3's load report in /cluster")
    assert collector.service.malformed["load"].total == 1
    assert collector.service.malformed["kv_events"].total == 1
    samples = await scrape(collector)
    assert samples["tandem_metrics_malformed_messages_total", (("stream", "load"),)] == 1
    assert samples["tandem_metrics_malformed_messages_total", (("stream", "kv_events"),)] == 1


async def test_run_metrics_announces_its_port(
        bus_config: BusConfig, capsys: pytest.CaptureFixture[str]) -> None:
    ready = asyncio.Event()
    task = asyncio.create_task(run_metrics(MetricsConfig(port=0, bus=bus_config), ready=ready))
    try:
        await asyncio.wait_for(ready.wait(), DEADLINE_S)
        announced = re.search(r"tandem-metrics listening on (http://127\.0\.0\.1:(\d+))",
                              capsys.readouterr().err)
        assert announced is not None and int(announced.group(2)) > 0
        async with httpx.AsyncClient(base_url=announced.group(1)) as client:
            response = await client.get("/health")
        assert response.status_code == 200 and response.json() == {"status": "ok"}
    finally:
        task.cancel()
        results = await asyncio.gather(task, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)


async def test_transfer_records_become_prometheus_metrics(bus: Bus, bus_config: BusConfig) -> None:
    from services.metrics.config import MetricsConfig
    from services.metrics.service import MetricsService
    from shared.schemas import TransferRecord

    service = MetricsService(MetricsConfig(bus=bus_config, port=0), bus)
    await service.start()
    try:
        for outcome, ok in (("done", 4), ("failed", 1)):
            record = TransferRecord(worker_id="d1", request_id="r", kind="pull", peer_worker_id="p1", outcome=outcome,
                                    blocks=4, blocks_ok=ok, bytes=ok * 16384, duration_s=0.002,
                                    pulled_tokens=ok * 16, recomputed_tokens=(4 - ok) * 16)
            await bus.client.publish(bus_config.subjects.kv_transfers("d1"), encode(record))
        await bus.client.publish(bus_config.subjects.kv_transfers("d1"), b"junk")
        sample = service.registry.get_sample_value
        await wait_for(lambda: sample("tandem_kv_transfers_total", {"kind": "pull", "outcome": "failed"}) == 1.0,
                       DEADLINE_S, "the transfer records counted")
        assert sample("tandem_kv_transfer_bytes_total", {"kind": "pull"}) == 5 * 16384
        assert sample("tandem_kv_transfer_tokens_total", {"kind": "pull", "source": "recomputed"}) == 48
        assert sample("tandem_kv_transfer_blocks_total", {"kind": "pull", "result": "failed"}) == 3
        assert sample("tandem_kv_transfer_seconds_count", {"kind": "pull", "role": "unknown"}) == 2
        await wait_for(lambda: service.malformed["kv_transfers"].total == 1, DEADLINE_S, "the junk counted")
    finally:
        await service.stop()
