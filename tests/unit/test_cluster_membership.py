"""The membership mirror and the load stream on plain bytes (no bus): typed member events,
malformed values, stale load snapshots."""

from __future__ import annotations

import msgspec
import pytest

from shared.cluster.load_stream import LoadStream, is_stale
from shared.cluster.member_events import MemberChange, MemberEvent, member_change
from shared.cluster.membership_mirror import MembershipMirror
from shared.codec import MalformedCounter, encode
from shared.schemas import LoadSnapshot, WorkerCapacity, WorkerRegistration, WorkerRole, WorkerStatus
from shared.subjects import Subjects

NO_BUS = None  # the mirror and the stream touch the bus only in start() and stop()


def registration(worker_id: str = "w1", *, started_at: float = 100.0, heartbeat_at: float = 100.0,
                 status: WorkerStatus = WorkerStatus.ACTIVE) -> WorkerRegistration:
    return WorkerRegistration(
        worker_id=worker_id, role=WorkerRole.DECODE, model="tiny", engine="sim", block_size=16,
        compat_hash="abc", capacity=WorkerCapacity(kv_blocks=64, max_num_seqs=8, max_model_len=2048),
        status=status, started_at=started_at, heartbeat_at=heartbeat_at)


def load(worker_id: str = "w1", *, seq: int, ts: float, running: int = 0) -> LoadSnapshot:
    return LoadSnapshot(worker_id=worker_id, seq=seq, ts=ts, running=running, waiting=0, kv_total_blocks=64,
                        kv_used_blocks=0, kv_cached_blocks=0, prompt_tokens_total=0, cached_tokens_total=0,
                        generated_tokens_total=0, pending_prefill_tokens=0)


class Recorder:
    def __init__(self) -> None:
        self.events: list[MemberEvent] = []
        self.malformed = MalformedCounter()
        self.mirror = MembershipMirror(NO_BUS, "members", self.events.append, self.malformed)  # type: ignore[arg-type]

    def take(self) -> list[tuple[MemberChange, str]]:
        taken = [(event.change, event.worker_id) for event in self.events]
        self.events.clear()
        return taken


def test_member_change_tells_a_join_a_restart_and_an_update_apart() -> None:
    first = registration()
    assert member_change(None, first) is MemberChange.JOINED
    assert member_change(first, registration(heartbeat_at=101.0)) is MemberChange.UPDATED
    assert member_change(first, registration(status=WorkerStatus.DRAINING)) is MemberChange.UPDATED
    assert member_change(first, registration(started_at=200.0)) is MemberChange.RESTARTED


def test_puts_and_deletes_become_typed_events() -> None:
    recorder = Recorder()
    mirror = recorder.mirror
    mirror.apply("w1", encode(registration()))
    mirror.apply("w1", encode(registration(heartbeat_at=101.0)))
    mirror.apply("w1", encode(registration(started_at=200.0, heartbeat_at=200.0)))
    assert recorder.events[1].previous == registration()
    assert recorder.events[2].previous is not None and recorder.events[2].previous.heartbeat_at == 101.0
    assert recorder.take() == [(MemberChange.JOINED, "w1"), (MemberChange.UPDATED, "w1"),
                               (MemberChange.RESTARTED, "w1")]
    assert mirror.members["w1"].started_at == 200.0
    mirror.apply("w1", None)
    [left] = recorder.events
    assert (left.change, left.registration.started_at) == (MemberChange.LEFT, 200.0)  # what left
    assert mirror.members == {}
    recorder.take()
    mirror.apply("w1", None)  # a delete marker of a key already gone
    mirror.apply("never-registered", None)
    assert recorder.take() == []


@pytest.mark.parametrize(("key", "value"), [
    ("w1", b"\xc1 not msgpack"),
    ("w1", encode(registration("someone-else"))),  # stored under another worker's key
    ("w.1", encode(registration("w.1"))),  # a bucket key that is no worker id (a subject token)
    ("w1", msgspec.msgpack.encode({"type": "registration", "worker_id": "w1"})),  # fields missing
])
def test_malformed_values_are_counted_and_the_last_good_registration_stays(key: str, value: bytes) -> None:
    recorder = Recorder()
    recorder.mirror.apply("w1", encode(registration()))
    recorder.take()
    recorder.mirror.apply(key, value)
    assert recorder.take() == []
    assert recorder.malformed.total == 1
    assert recorder.mirror.members == {"w1": registration()}


def test_is_stale_needs_both_seq_and_time_behind() -> None:
    last = load(seq=5, ts=50.0)
    assert not is_stale(None, last)
    assert is_stale(last, load(seq=5, ts=50.0))  # a duplicate
    assert is_stale(last, load(seq=4, ts=49.0))
    assert not is_stale(last, load(seq=6, ts=51.0))
    assert not is_stale(last, load(seq=1, ts=60.0))  # a restarted worker counts from 1 again


class LoadRecorder:
    def __init__(self) -> None:
        self.snapshots: list[LoadSnapshot] = []
        self.malformed = MalformedCounter()
        self.stream = LoadStream(NO_BUS, Subjects(), self.snapshots.append, self.malformed)  # type: ignore[arg-type]

    def send(self, snapshot: LoadSnapshot) -> None:
        self.stream.receive(encode(snapshot), f"load.{snapshot.worker_id}")

    def member(self, change: MemberChange, worker_id: str = "w1") -> None:
        self.stream.on_member(MemberEvent(change, worker_id, registration(worker_id)))

    def seqs(self) -> list[tuple[str, int]]:
        return [(snapshot.worker_id, snapshot.seq) for snapshot in self.snapshots]


def test_load_stream_drops_stale_snapshots_of_members() -> None:
    loads = LoadRecorder()
    loads.member(MemberChange.JOINED)
    for seq, ts in ((1, 10.0), (2, 11.0), (2, 11.0), (1, 10.0), (3, 12.0)):
        loads.send(load(seq=seq, ts=ts))
    assert loads.seqs() == [("w1", 1), ("w1", 2), ("w1", 3)]
    assert loads.stream.stale == 2
    loads.stream.receive(b"garbage", "load.w1")
    assert loads.malformed.total == 1 and len(loads.snapshots) == 3


def test_a_restart_starts_the_numbers_over_and_non_members_pass_unchecked() -> None:
    loads = LoadRecorder()
    loads.member(MemberChange.JOINED)
    loads.send(load(seq=9, ts=90.0))
    loads.member(MemberChange.UPDATED)  # a heartbeat changes nothing
    loads.send(load(seq=9, ts=90.0))
    loads.member(MemberChange.RESTARTED)  # a new process, whose clock may even be behind
    loads.send(load(seq=1, ts=5.0))
    assert loads.seqs() == [("w1", 9), ("w1", 1)]
    loads.member(MemberChange.LEFT)
    loads.send(load(seq=1, ts=5.0))  # no longer a member: handed on, the caller drops it
    loads.send(load("stranger", seq=3, ts=1.0))
    loads.send(load("stranger", seq=3, ts=1.0))
    assert loads.seqs() == [("w1", 9), ("w1", 1), ("w1", 1), ("stranger", 3), ("stranger", 3)]
    assert loads.stream.stale == 1
