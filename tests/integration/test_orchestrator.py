"""The orchestrator against a real nats-server: heartbeats in, membership changes out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple

import msgspec
import pytest
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.main import run_orchestrator
from services.orchestrator.service import OrchestratorService
from shared.bus import Bus, connect
from shared.cluster.bucket_mirror import BucketMirror
from shared.codec import Codec, encode
from shared.config import BusConfig, MembershipConfig
from shared.schemas import MembershipChange, WorkerCapacity, WorkerRegistration, WorkerRole
from tests.waiting import wait_for

HEARTBEAT_S = 0.1
TTL_S = 0.5
SWEEP_S = 0.05
DEADLINE_S = TTL_S + SWEEP_S + 2.0  # generous slack for a loaded 2-core machine

changes_codec: Codec[MembershipChange] = Codec(MembershipChange)


def make_config(bus_config: BusConfig) -> OrchestratorConfig:
    return OrchestratorConfig(sweep_interval_s=SWEEP_S, bus=bus_config,
                              membership=MembershipConfig(heartbeat_interval_s=HEARTBEAT_S, ttl_s=TTL_S))


def registration(worker_id: str) -> WorkerRegistration:
    now = time.time()
    return WorkerRegistration(
        worker_id=worker_id, role=WorkerRole.BOTH, model="tiny", engine="sim", block_size=16,
        compat_hash="abc", capacity=WorkerCapacity(kv_blocks=64, max_num_seqs=8, max_model_len=2048),
        started_at=now, heartbeat_at=now)


class FakeWorker:
    """Puts its registration every heartbeat interval, as a real worker does."""

    def __init__(self, kv: KeyValue, worker_id: str) -> None:
        self.kv = kv
        self.registration = registration(worker_id)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._beat())

    async def stop_heartbeats(self) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _beat(self) -> None:
        while True:
            beat = msgspec.structs.replace(self.registration, heartbeat_at=time.time())
            await self.kv.put(self.registration.worker_id, encode(beat))
            await asyncio.sleep(HEARTBEAT_S)  # the heartbeat period, not a synchronisation wait


@pytest.fixture
async def changes(bus: Bus, bus_config: BusConfig) -> AsyncIterator[asyncio.Queue[MembershipChange]]:
    queue: asyncio.Queue[MembershipChange] = asyncio.Queue()

    async def on_change(msg) -> None:  # type: ignore[no-untyped-def]
        queue.put_nowait(changes_codec.decode(msg.data))

    subscription = await bus.client.subscribe(bus_config.subjects.membership_changes, cb=on_change)
    await bus.client.flush()
    yield queue
    await subscription.unsubscribe()


@pytest.fixture
async def orchestrator(bus_config: BusConfig) -> AsyncIterator[OrchestratorService]:
    service_bus = await connect(bus_config.nats_url, "test-orchestrator")
    service = OrchestratorService(make_config(bus_config), service_bus)
    await service.start()
    yield service
    await service.stop()
    await service_bus.close()


@pytest.fixture
async def members(bus: Bus, bus_config: BusConfig) -> KeyValue:
    return await bus.key_value(bus_config.subjects.members_bucket,
                               ttl_s=make_config(bus_config).membership.bucket_ttl_s)


class Match(NamedTuple):
    test: Callable[[MembershipChange], bool]
    description: str


async def next_change(queue: asyncio.Queue[MembershipChange], match: Match,
                      timeout_s: float = DEADLINE_S) -> MembershipChange:
    """The first change matching `match`, skipping others; fails after the deadline."""
    found: list[MembershipChange] = []

    def arrived() -> bool:
        while not found and not queue.empty():
            change = queue.get_nowait()
            if match.test(change):
                found.append(change)
        return bool(found)

    await wait_for(arrived, timeout_s, match.description)
    return found[0]


def is_(kind: str, worker_id: str, reason: str | None = None) -> Match:
    return Match(lambda c: c.kind == kind and c.worker_id == worker_id and reason in (None, c.reason),
                 f"{worker_id} {kind}" + (f" ({reason})" if reason else ""))


async def test_heartbeats_join_and_silence_removes(
        orchestrator: OrchestratorService, changes: asyncio.Queue[MembershipChange],
        members: KeyValue, bus: Bus, bus_config: BusConfig) -> None:
    router_view: dict[str, bool] = {}
    mirror = BucketMirror(bus, bus_config.subjects.members_bucket,
                          lambda key, value: router_view.__setitem__(key, value is not None))
    await mirror.start()
    worker = FakeWorker(members, "w1")
    worker.start()
    try:
        joined = await next_change(changes, is_("joined", "w1"))
        assert joined.registration is not None and joined.registration.model == "tiny"
        await wait_for(lambda: router_view.get("w1") is True, DEADLINE_S, "the mirror to see w1")

        await worker.stop_heartbeats()
        silent_since = time.monotonic()
        await next_change(changes, is_("removed", "w1", "heartbeat_lost"))
        assert time.monotonic() - silent_since >= TTL_S - HEARTBEAT_S
        # The key is gone from the bucket, so a router mirroring it drops the worker.
        with pytest.raises(NotFoundError):
            await members.get("w1")
        await wait_for(lambda: router_view.get("w1") is False, DEADLINE_S, "the mirror to drop w1")
        assert "w1" not in orchestrator.table.members
    finally:
        await worker.stop_heartbeats()
        await mirror.stop()


async def test_deregistration_via_run_orchestrator(
        bus_config: BusConfig, changes: asyncio.Queue[MembershipChange], members: KeyValue) -> None:
    ready = asyncio.Event()
    task = asyncio.create_task(run_orchestrator(make_config(bus_config), ready=ready))
    await asyncio.wait_for(ready.wait(), DEADLINE_S)
    worker = FakeWorker(members, "w2")
    worker.start()
    try:
        await next_change(changes, is_("joined", "w2"))
        await worker.stop_heartbeats()
        await members.delete("w2")  # a clean shutdown
        await next_change(changes, is_("removed", "w2", "deregistered"), timeout_s=TTL_S)
    finally:
        await worker.stop_heartbeats()
        task.cancel()
        results = await asyncio.gather(task, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)  # a clean stop, nothing else raised


async def test_malformed_values_are_counted_and_dropped(
        orchestrator: OrchestratorService, changes: asyncio.Queue[MembershipChange],
        members: KeyValue) -> None:
    await members.put("garbage", b"\xc1 not msgpack")
    await members.put("impostor", encode(registration("someone-else")))
    worker = FakeWorker(members, "w3")
    worker.start()
    try:
        await next_change(changes, is_("joined", "w3"))
        await wait_for(lambda: orchestrator.malformed.total == 2, DEADLINE_S, "two malformed entries counted")
        assert set(orchestrator.table.members) == {"w3"}
    finally:
        await worker.stop_heartbeats()


async def test_value_expired_by_bucket_ttl_is_deleted_for_watchers(
        bus: Bus, bus_config: BusConfig, changes: asyncio.Queue[MembershipChange]) -> None:
    # A bucket whose TTL is shorter than the membership TTL: JetStream drops the value
    # silently, so only the orchestrator's delete marker tells mirrors the worker left.
    short_lived = await bus.key_value(bus_config.subjects.members_bucket, ttl_s=TTL_S / 2)
    router_view: dict[str, bool] = {}
    mirror = BucketMirror(bus, bus_config.subjects.members_bucket,
                          lambda key, value: router_view.__setitem__(key, value is not None))
    await mirror.start()
    service_bus = await connect(bus_config.nats_url, "test-orchestrator")
    service = OrchestratorService(make_config(bus_config), service_bus)
    await service.start()
    try:
        await short_lived.put("w4", encode(registration("w4")))  # one heartbeat, then silence
        await next_change(changes, is_("joined", "w4"))
        await next_change(changes, is_("removed", "w4", "heartbeat_lost"))
        await wait_for(lambda: router_view.get("w4") is False, DEADLINE_S, "the mirror to drop w4")
    finally:
        await service.stop()
        await service_bus.close()
        await mirror.stop()


async def test_a_stall_of_the_orchestrators_own_loop_removes_nobody(
        orchestrator: OrchestratorService, changes: asyncio.Queue[MembershipChange], members: KeyValue) -> None:
    worker = FakeWorker(members, "w1")
    worker.start()
    try:
        await next_change(changes, is_("joined", "w1"))
        time.sleep(TTL_S * 4)  # blocks the loop: the orchestrator reads no heartbeat for four TTLs
        await asyncio.sleep(TTL_S * 2)  # heartbeats flow again; a removal would have come by now
        assert changes.empty(), changes.get_nowait()
        assert "w1" in orchestrator.table.members
        await worker.stop_heartbeats()  # a real silence still removes it
        await next_change(changes, is_("removed", "w1", "heartbeat_lost"))
    finally:
        await worker.stop_heartbeats()
