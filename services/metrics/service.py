"""The metrics collector's NATS adapter: event streams in, `ClusterView` updated.

Subscribes to every worker's load snapshots (`LoadStream`) and KV events and to the
router's request records; mirrors the members bucket (`MembershipMirror`) so the view
tracks exactly the registered workers. When the view reports a KV sequence gap, sends
`KvSnapshotRequest` to that worker's control subject. Malformed messages are counted per
stream, logged once, and dropped. Request records, transfer records and departures reach
the view with the arrival time on `clock` (wall clock), for its recent activity.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from services.metrics.cluster_view import ClusterView
from services.metrics.config import MetricsConfig
from services.metrics.exposition import TransferMetrics, build_registry
from shared.bus import Bus, unsubscribe_quietly
from shared.cluster.load_stream import LoadStream
from shared.cluster.member_events import MemberChange, MemberEvent
from shared.cluster.membership_mirror import MembershipMirror
from shared.codec import Codec, MalformedCounter, encode
from shared.prometheus import headers_exemplar
from shared.schemas import KvSnapshotRequest, RequestRecord, TransferRecord
from shared.schemas.kv_events import KvEventBatchWithoutTokens

log = logging.getLogger(__name__)


class MetricsService:
    def __init__(self, config: MetricsConfig, bus: Bus, clock: Callable[[], float] = time.time) -> None:
        self._bus = bus
        self.clock = clock
        self._subjects = config.bus.subjects
        self.view = ClusterView()
        self.malformed = {stream: MalformedCounter()
                          for stream in ("load", "kv_events", "requests", "members", "kv_transfers")}
        self.registry, self._histograms = build_registry(self.view, self.malformed)
        self._roles: dict[str, str] = {}  # members' roles, for per-role transfer times
        self.transfer_metrics = TransferMetrics(self.registry, self._roles.get)
        # The view reads engine block hashes only: token ids are skipped, not decoded.
        self._kv_batches: Codec[KvEventBatchWithoutTokens] = Codec(KvEventBatchWithoutTokens,
                                                                   self.malformed["kv_events"])
        self._records: Codec[RequestRecord] = Codec(RequestRecord, self.malformed["requests"])
        self._transfers: Codec[TransferRecord] = Codec(TransferRecord, self.malformed["kv_transfers"])
        self.snapshot_requests_sent = 0
        self._members = MembershipMirror(bus, self._subjects.members_bucket, self._on_member,
                                         self.malformed["members"], ttl_s=config.membership.bucket_ttl_s,
                                         grace_s=config.membership.ttl_s)  # a NATS restart drops no one
        self._loads = LoadStream(bus, self._subjects, self.view.apply_load, self.malformed["load"])
        self._subscriptions: list[Subscription] = []

    @property
    def bus_connected(self) -> bool:
        return self._bus.client.is_connected

    async def start(self) -> None:
        # Membership first, so the first load and KV messages find their workers known.
        await self._members.start()
        await self._loads.start()
        client = self._bus.client
        self._subscriptions = [
            await client.subscribe(self._subjects.kv_events_all, cb=self._on_kv),
            await client.subscribe(self._subjects.request_events, cb=self._on_request),
            await client.subscribe(self._subjects.kv_transfers_all, cb=self._on_transfer),
        ]
        await client.flush()  # subscriptions are live on the server when start() returns

    async def stop(self) -> None:
        await unsubscribe_quietly(self._subscriptions, "metrics collector")
        self._subscriptions = []
        await self._loads.stop()
        await self._members.stop()

    def _on_member(self, event: MemberEvent) -> None:
        self._loads.on_member(event)
        if event.change is MemberChange.LEFT:
            self.view.remove_worker(event.worker_id, now=self.clock())
            self._roles.pop(event.worker_id, None)
        else:
            self.view.apply_registration(event.registration)
            self._roles[event.worker_id] = event.registration.role.value

    async def _on_kv(self, msg: Msg) -> None:
        batch = self._kv_batches.decode_or_none(msg.data, msg.subject)
        if batch is not None and self.view.apply_kv(batch):
            await self._request_kv_snapshot(batch.worker_id)

    async def _on_request(self, msg: Msg) -> None:
        record = self._records.decode_or_none(msg.data, msg.subject)
        if record is not None:
            self.view.apply_request(record, now=self.clock())
            self._histograms.observe(record)

    async def _on_transfer(self, msg: Msg) -> None:
        record = self._transfers.decode_or_none(msg.data, msg.subject)
        if record is not None:
            self.transfer_metrics.observe(record, headers_exemplar(msg.headers))
            self.view.apply_transfer(record, now=self.clock())

    async def _request_kv_snapshot(self, worker_id: str) -> None:
        log.info("KV stream of %s is out of sync: requesting a snapshot", worker_id)
        await self._bus.client.publish(self._subjects.control(worker_id, "kv_snapshot"), encode(KvSnapshotRequest()))
        self.snapshot_requests_sent += 1
