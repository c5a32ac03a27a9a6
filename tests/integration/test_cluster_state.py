"""The cluster-state adapters against a real nats-server: the membership mirror (across a
server restart) and the load stream."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from shared.bus import Bus, connect
from shared.cluster.load_stream import LoadStream
from shared.cluster.member_events import MemberChange, MemberEvent
from shared.cluster.membership_mirror import MembershipMirror
from shared.codec import MalformedCounter, encode
from shared.config import BusConfig
from shared.nats_server import EmbeddedNats
from shared.schemas import LoadSnapshot, WorkerCapacity, WorkerRegistration, WorkerRole
from tests.waiting import wait_for

DEADLINE_S = 10.0


def registration(worker_id: str, started_at: float) -> WorkerRegistration:
    return WorkerRegistration(
        worker_id=worker_id, role=WorkerRole.BOTH, model="tiny", engine="sim", block_size=16,
        compat_hash="abc", capacity=WorkerCapacity(kv_blocks=64, max_num_seqs=8, max_model_len=2048),
        started_at=started_at, heartbeat_at=time.time())


def load(worker_id: str, seq: int, ts: float) -> LoadSnapshot:
    return LoadSnapshot(worker_id=worker_id, seq=seq, ts=ts, running=seq, waiting=0, kv_total_blocks=64,
                        kv_used_blocks=0, kv_cached_blocks=0, prompt_tokens_total=0, cached_tokens_total=0,
                        generated_tokens_total=0, pending_prefill_tokens=0)


@asynccontextmanager
async def own_server(tmp_path: Path, namespace: str) -> AsyncIterator[tuple[EmbeddedNats, Bus, Bus, str]]:
    """A nats-server of the test's own (the test restarts it), the mirror's connection, the
    workers' connection, and the members bucket's name."""
    nats = EmbeddedNats(str(tmp_path / "nats")).start()
    bus = await connect(nats.url, "test-mirror")
    writer = await connect(nats.url, "test-worker")
    try:
        yield nats, bus, writer, BusConfig(nats_url=nats.url, namespace=namespace).subjects.members_bucket
    finally:
        await bus.close()
        await writer.close()
        nats.stop()
        shutil.rmtree(tmp_path / "nats", ignore_errors=True)


async def next_event(events: asyncio.Queue[MemberEvent]) -> tuple[MemberChange, str]:
    event = await asyncio.wait_for(events.get(), DEADLINE_S)
    return event.change, event.worker_id


async def test_membership_mirror_follows_the_bucket_across_a_server_restart(tmp_path) -> None:
    async with own_server(tmp_path, "mirror") as (nats, bus, writer, bucket):
        events: asyncio.Queue[MemberEvent] = asyncio.Queue()
        malformed = MalformedCounter()
        mirror = MembershipMirror(bus, bucket, events.put_nowait, malformed)
        try:
            members = await writer.key_value(bucket)
            await members.put("w1", encode(registration("w1", started_at=1.0)))
            await mirror.start()  # the members already there are reported before start() returns
            assert events.get_nowait().change is MemberChange.JOINED
            await members.put("w1", encode(registration("w1", started_at=1.0)))  # a heartbeat
            await members.put("junk", b"\xc1")
            await members.put("w1", encode(registration("w1", started_at=2.0)))
            await members.put("w2", encode(registration("w2", started_at=1.0)))
            await members.delete("w2")
            assert [await next_event(events) for _ in range(4)] == [
                (MemberChange.UPDATED, "w1"), (MemberChange.RESTARTED, "w1"),
                (MemberChange.JOINED, "w2"), (MemberChange.LEFT, "w2")]
            assert malformed.total == 1

            await asyncio.to_thread(nats.stop)
            await asyncio.to_thread(nats.start)  # same port; the memory bucket starts empty
            # The recreated watcher finds the bucket empty: w1 is gone, then its next heartbeat is a join.
            assert await next_event(events) == (MemberChange.LEFT, "w1")
            members = await writer.key_value(bucket)
            await members.put("w1", encode(registration("w1", started_at=2.0)))
            assert await next_event(events) == (MemberChange.JOINED, "w1")
            assert set(mirror.members) == {"w1"}
        finally:
            await mirror.stop()


@pytest.mark.parametrize("member", [True, False])
async def test_load_stream_drops_stale_and_malformed_snapshots(bus: Bus, bus_config: BusConfig, member: bool) -> None:
    received: asyncio.Queue[LoadSnapshot] = asyncio.Queue()
    malformed = MalformedCounter()
    stream = LoadStream(bus, bus_config.subjects, received.put_nowait, malformed)
    if member:
        stream.on_member(MemberEvent(MemberChange.JOINED, "w1", registration("w1", started_at=1.0)))
    await stream.start()
    await bus.client.flush()
    try:
        subject = bus_config.subjects.load("w1")
        for seq, ts in ((1, 10.0), (2, 11.0), (2, 11.0), (1, 10.0)):
            await bus.client.publish(subject, encode(load("w1", seq, ts)))
        await bus.client.publish(subject, b"garbage")
        await bus.client.publish(subject, encode(load("w1", 3, 12.0)))  # the last one: all before it arrived
        seqs: list[int] = []

        def last_arrived() -> bool:
            while not received.empty():
                seqs.append(received.get_nowait().seq)
            return bool(seqs) and seqs[-1] == 3

        await wait_for(last_arrived, DEADLINE_S, lambda: f"the snapshot with seq 3 (got {seqs})")
        # A member's stale snapshots are dropped; a non-member's are handed on for the caller to drop.
        assert seqs == ([1, 2, 3] if member else [1, 2, 2, 1, 3])
        assert (stream.stale, malformed.total) == (2 if member else 0, 1)
    finally:
        await stream.stop()


async def test_with_a_grace_a_server_restart_removes_only_members_not_put_back(tmp_path) -> None:
    async with own_server(tmp_path, "grace") as (nats, bus, writer, bucket):
        events: asyncio.Queue[MemberEvent] = asyncio.Queue()
        mirror = MembershipMirror(bus, bucket, events.put_nowait, MalformedCounter(), grace_s=1.0)
        try:
            members = await writer.key_value(bucket)
            for worker_id in ("w1", "w2"):
                await members.put(worker_id, encode(registration(worker_id, started_at=1.0)))
            await mirror.start()
            assert {events.get_nowait().worker_id for _ in range(2)} == {"w1", "w2"}

            await asyncio.to_thread(nats.stop)
            await asyncio.to_thread(nats.start)  # same port; the memory bucket starts empty
            # both stay members, unconfirmed (not to be routed to) until their registration is back
            await wait_for(lambda: mirror.unconfirmed == {"w1", "w2"}, DEADLINE_S, "both members unconfirmed")
            assert set(mirror.members) == {"w1", "w2"} and events.empty()
            members = await writer.key_value(bucket)
            await members.put("w1", encode(registration("w1", started_at=1.0)))  # w1 re-registers
            assert await next_event(events) == (MemberChange.UPDATED, "w1")
            assert mirror.unconfirmed == {"w2"}
            # w2 never comes back: removed once the grace is over, and only then
            assert await next_event(events) == (MemberChange.LEFT, "w2")
            assert set(mirror.members) == {"w1"} and not mirror.unconfirmed
        finally:
            await mirror.stop()


async def test_load_stream_refuses_timestamps_from_the_far_future(bus: Bus, bus_config: BusConfig) -> None:
    received: list[LoadSnapshot] = []
    malformed = MalformedCounter()
    now = 1000.0
    stream = LoadStream(bus, bus_config.subjects, received.append, malformed, clock=lambda: now)
    stream.on_member(MemberEvent(MemberChange.JOINED, "w1", registration("w1", started_at=1.0)))
    subject = bus_config.subjects.load("w1")
    stream.receive(encode(load("w1", 5, now - 1)), subject)
    stream.receive(encode(load("w1", 2**62, now + 1e9)), subject)  # forged: would freeze the view
    stream.receive(encode(load("w1", 6, float("nan"))), subject)
    stream.receive(encode(load("w1", 6, now)), subject)  # the worker's next one still counts
    assert [snapshot.seq for snapshot in received] == [5, 6]
    assert malformed.total == 2
    stream.receive(encode(load("w1", 2**62, now + 1)), subject)  # far ahead in seq, plausible in time
    stream.receive(encode(load("w1", 7, now + 2)), subject)  # newer in time: taken, the view moves on
    # a restarted worker numbers from 1 again: taken once its new registration is seen
    stream.on_member(MemberEvent(MemberChange.RESTARTED, "w1", registration("w1", started_at=2.0)))
    stream.receive(encode(load("w1", 1, now + 3)), subject)
    assert [snapshot.seq for snapshot in received] == [5, 6, 2**62, 7, 1]
