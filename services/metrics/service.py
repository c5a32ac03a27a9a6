"""The metrics collector's NATS adapter: event streams in, `ClusterView` updated.

Subscribes to every worker's load snapshots and KV events and to the router's request
records; mirrors the members bucket so the view tracks exactly the registered workers.
When the view reports a KV sequence gap, sends `KvSnapshotRequest` to that worker's
control subject. Malformed messages are counted per stream, logged once, and dropped.
"""

from __future__ import annotations

import logging

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from services.metrics.cluster_view import ClusterView
from services.metrics.exposition import TransferMetrics, build_registry
from shared.bus import BucketMirror, Bus
from shared.codec import Codec, MalformedCounter, encode
from shared.config import MetricsConfig
from shared.schemas import (
    KvEventBatch,
    KvSnapshotRequest,
    LoadSnapshot,
    RequestRecord,
    TransferRecord,
    WorkerRegistration,
)
from shared.subjects import check_token

log = logging.getLogger(__name__)


class MetricsService:
    def __init__(self, config: MetricsConfig, bus: Bus) -> None:
        self._bus = bus
        self._subjects = config.bus.subjects
        self._members_bucket_ttl_s = config.membership.bucket_ttl_s
        self.view = ClusterView()
        self.malformed = {stream: MalformedCounter()
                          for stream in ("load", "kv_events", "requests", "members", "kv_transfers")}
        self.registry, self._histograms = build_registry(self.view, self.malformed)
        self.transfer_metrics = TransferMetrics(self.registry)
        self._loads: Codec[LoadSnapshot] = Codec(LoadSnapshot, self.malformed["load"])
        self._kv_batches: Codec[KvEventBatch] = Codec(KvEventBatch, self.malformed["kv_events"])
        self._records: Codec[RequestRecord] = Codec(RequestRecord, self.malformed["requests"])
        self._transfers: Codec[TransferRecord] = Codec(TransferRecord, self.malformed["kv_transfers"])
        self._registrations: Codec[WorkerRegistration] = Codec(WorkerRegistration,
                                                               self.malformed["members"])
        self.snapshot_requests_sent = 0
        self._mirror: BucketMirror | None = None
        self._subscriptions: list[Subscription] = []

    @property
    def bus_connected(self) -> bool:
        return self._bus.client.is_connected

    async def start(self) -> None:
        # Membership first, so the first load and KV messages find their workers known.
        self._mirror = BucketMirror(self._bus, self._subjects.members_bucket, self._on_member,
                                    ttl_s=self._members_bucket_ttl_s)
        await self._mirror.start()
        client = self._bus.client
        self._subscriptions = [
            await client.subscribe(self._subjects.load_all, cb=self._on_load),
            await client.subscribe(self._subjects.kv_events_all, cb=self._on_kv),
            await client.subscribe(self._subjects.request_events, cb=self._on_request),
            await client.subscribe(self._subjects.kv_transfers_all, cb=self._on_transfer),
        ]
        await client.flush()  # subscriptions are live on the server when start() returns

    async def stop(self) -> None:
        for subscription in self._subscriptions:
            try:
                await subscription.unsubscribe()
            except Exception as error:  # connection already closed: nothing left to undo
                log.debug("unsubscribe failed: %s", error)
        self._subscriptions = []
        if self._mirror is not None:
            await self._mirror.stop()
            self._mirror = None

    def _on_member(self, key: str, value: bytes | None) -> None:
        if value is None:
            self.view.remove_worker(key)
            return
        registration = self._registrations.decode_or_none(value, self._subjects.members_bucket)
        if registration is None:
            return
        if registration.worker_id != key or not _is_token(key):
            self.malformed["members"].record(
                self._subjects.members_bucket, ValueError(f"bad registration under key {key!r}"))
            return
        self.view.apply_registration(registration)

    async def _on_load(self, msg: Msg) -> None:
        snapshot = self._loads.decode_or_none(msg.data, msg.subject)
        if snapshot is not None:
            self.view.apply_load(snapshot)

    async def _on_kv(self, msg: Msg) -> None:
        batch = self._kv_batches.decode_or_none(msg.data, msg.subject)
        if batch is not None and self.view.apply_kv(batch):
            await self._request_kv_snapshot(batch.worker_id)

    async def _on_request(self, msg: Msg) -> None:
        record = self._records.decode_or_none(msg.data, msg.subject)
        if record is not None:
            self.view.apply_request(record)
            self._histograms.observe(record)

    async def _on_transfer(self, msg: Msg) -> None:
        record = self._transfers.decode_or_none(msg.data, msg.subject)
        if record is not None:
            self.transfer_metrics.observe(record)

    async def _request_kv_snapshot(self, worker_id: str) -> None:
        log.info("KV stream of %s is out of sync: requesting a snapshot", worker_id)
        await self._bus.client.publish(self._subjects.control(worker_id), encode(KvSnapshotRequest()))
        self.snapshot_requests_sent += 1


def _is_token(worker_id: str) -> bool:
    # Bucket keys may contain '.', which a worker id (a subject token) may not.
    try:
        check_token(worker_id, "worker id")
    except ValueError:
        return False
    return True
