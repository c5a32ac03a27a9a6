"""The worker pool's own accounting on plain data (no bus): requests in flight and the
uncached prompt tokens routed to a worker until its first token, corrected by load reports."""

from __future__ import annotations

import time

from services.router.fleet.worker_pool import WorkerPool
from shared.codec import MalformedCounter, encode
from shared.errors import Disconnected
from shared.schemas import LoadSnapshot, WorkerCapacity, WorkerRegistration, WorkerRole
from shared.subjects import Subjects


def pool_with(*worker_ids: str) -> WorkerPool:
    pool = WorkerPool(None, Subjects(), MalformedCounter())  # type: ignore[arg-type]  # no bus: callbacks only
    for worker_id in worker_ids:
        registration = WorkerRegistration(
            worker_id=worker_id, role=WorkerRole.BOTH, model="m", engine="fake", block_size=16, compat_hash="h",
            capacity=WorkerCapacity(kv_blocks=64, max_num_seqs=8, max_model_len=1024), started_at=time.time(),
            heartbeat_at=time.time())
        pool._members.apply(worker_id, encode(registration))
    return pool


def report(pool: WorkerPool, worker_id: str, seq: int, running: int, pending_prefill_tokens: int) -> None:
    snapshot = LoadSnapshot(worker_id=worker_id, seq=seq, ts=time.time(), running=running, waiting=0,
                            kv_total_blocks=64, kv_used_blocks=0, kv_cached_blocks=0, prompt_tokens_total=0,
                            cached_tokens_total=0, generated_tokens_total=0,
                            pending_prefill_tokens=pending_prefill_tokens)
    pool._loads.receive(encode(snapshot), "load")


def view(pool: WorkerPool, worker_id: str):
    return next(view for view in pool.views() if view.worker_id == worker_id)


class Listener:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.kv_tokens: dict[str, int] = {}

    def worker_joined(self, worker_id: str, block_size: int, kv_tokens: int = 0, *, model: str,
                      lends_host_tier: bool = False) -> None:
        self.calls.append(("joined", worker_id))
        self.kv_tokens[worker_id] = kv_tokens

    def worker_left(self, worker_id: str) -> None:
        self.calls.append(("left", worker_id))


def put(pool: WorkerPool, worker_id: str, *, started_at: float, heartbeat_at: float) -> None:
    pool._members.apply(worker_id, encode(WorkerRegistration(
        worker_id=worker_id, role=WorkerRole.BOTH, model="m", engine="fake", block_size=16, compat_hash="h",
        capacity=WorkerCapacity(kv_blocks=64, max_num_seqs=8, max_model_len=1024), started_at=started_at,
        heartbeat_at=heartbeat_at)))


def test_membership_heartbeats_restarts_and_leaves() -> None:
    listener = Listener()
    pool = WorkerPool(None, Subjects(), MalformedCounter(), listeners=[listener])  # type: ignore[arg-type]
    put(pool, "w1", started_at=1.0, heartbeat_at=1.0)
    routed = pool.begin("w1", "r1")
    report(pool, "w1", seq=7, running=1, pending_prefill_tokens=0)
    put(pool, "w1", started_at=1.0, heartbeat_at=2.0)  # a heartbeat
    assert routed.lost is None and view(pool, "w1").reported_load == 1
    assert listener.calls == [("left", "w1"), ("joined", "w1")]  # indexed afresh when it joins
    assert listener.kv_tokens == {"w1": 64 * 16}  # its KV pool, which bounds the prefixes kept resident

    put(pool, "w1", started_at=5.0, heartbeat_at=5.0)  # a new process under the same id
    assert isinstance(routed.lost, Disconnected) and "restarted" in str(routed.lost)
    assert view(pool, "w1").reported_load is None  # its old load is gone with it
    assert listener.calls[2:] == [("left", "w1"), ("joined", "w1")]  # its cache is gone: purged
    report(pool, "w1", seq=1, running=3, pending_prefill_tokens=0)  # it counts from 1 again
    assert view(pool, "w1").reported_load == 3

    again = pool.begin("w1", "r2")
    pool._members.apply("w1", None)  # it left
    assert isinstance(again.lost, Disconnected) and "left" in str(again.lost)
    assert pool.worker_ids == [] and listener.calls[4:] == [("left", "w1")]
    report(pool, "w1", seq=2, running=3, pending_prefill_tokens=0)  # a late snapshot cannot bring it back
    assert pool.worker_ids == []


def test_stale_load_reports_and_malformed_registrations_are_dropped() -> None:
    malformed = MalformedCounter()
    pool = WorkerPool(None, Subjects(), malformed)  # type: ignore[arg-type]
    put(pool, "w1", started_at=1.0, heartbeat_at=1.0)
    report(pool, "w1", seq=5, running=4, pending_prefill_tokens=0)
    snapshot = LoadSnapshot(worker_id="w1", seq=4, ts=0.0, running=9, waiting=0, kv_total_blocks=64,
                            kv_used_blocks=0, kv_cached_blocks=0, prompt_tokens_total=0, cached_tokens_total=0,
                            generated_tokens_total=0, pending_prefill_tokens=0)
    pool._loads.receive(encode(snapshot), "load")  # older in both number and time
    assert view(pool, "w1").reported_load == 4
    pool._members.apply("w2", b"garbage")
    put(pool, "w.3", started_at=1.0, heartbeat_at=1.0)  # not a worker id
    assert pool.worker_ids == ["w1"] and malformed.total == 2


def test_prompt_tokens_count_until_the_first_token_and_requests_until_the_end() -> None:
    pool = pool_with("w1")
    first = pool.begin("w1", "r1", prefill_tokens=300)
    second = pool.begin("w1", "r2", prefill_tokens=200)
    assert (view(pool, "w1").in_flight, view(pool, "w1").predicted_prefill_tokens) == (2, 500)
    first.prefill_done()
    first.prefill_done()  # idempotent
    assert view(pool, "w1").predicted_prefill_tokens == 200
    second.end()  # ended before its first token (failed, cancelled): its tokens go too
    first.end()
    assert (view(pool, "w1").in_flight, view(pool, "w1").predicted_prefill_tokens) == (0, 0)


def test_a_load_report_replaces_what_it_already_counts() -> None:
    pool = pool_with("w1")
    pool.begin("w1", "r1", prefill_tokens=300)
    report(pool, "w1", seq=1, running=1, pending_prefill_tokens=1000)  # other routers' work too
    assert view(pool, "w1").predicted_prefill_tokens == 1000
    later = pool.begin("w1", "r2", prefill_tokens=50)
    assert view(pool, "w1").predicted_prefill_tokens == 1050
    later.prefill_done()
    assert (view(pool, "w1").predicted_load, view(pool, "w1").predicted_prefill_tokens) == (2, 1000)


def test_a_pair_prefill_part_is_a_request_in_flight_that_does_not_decode_there() -> None:
    pool = pool_with("w1")
    part = pool.begin("w1", "r1", prefill_tokens=1000, decodes=False)
    pool.begin("w1", "r2", prefill_tokens=300)
    report(pool, "w1", seq=1, running=2, pending_prefill_tokens=1300)  # the report counts both
    assert (view(pool, "w1").predicted_load, view(pool, "w1").decoding_load) == (2, 1)
    part.end()  # its KV is ready for its decode worker
    assert (view(pool, "w1").predicted_load, view(pool, "w1").decoding_load) == (1, 1)


def test_after_a_reconnect_a_load_report_confirms_its_worker() -> None:
    """On a NATS cluster the bucket's fresh watcher may wait seconds for a leader election
    after a reconnect; a worker whose load report arrives meanwhile is alive: routable again."""
    pool = WorkerPool(None, Subjects(), MalformedCounter(), reconnect_grace_s=15.0)  # type: ignore[arg-type]
    for worker_id in ("w1", "w2"):
        put(pool, worker_id, started_at=1.0, heartbeat_at=1.0)
    pool._members._mirror.unconfirmed = {"w1", "w2"}  # what the disconnect hook does to the keys it held
    assert pool.views() == [] and pool.member_ids() == ["w1", "w2"]
    report(pool, "w1", seq=1, running=0, pending_prefill_tokens=0)
    assert [view.worker_id for view in pool.views()] == ["w1"]
    assert pool._members.unconfirmed == {"w2"}
    report(pool, "w1", seq=2, running=0, pending_prefill_tokens=0)  # already confirmed: nothing changes
    assert [view.worker_id for view in pool.views()] == ["w1"]
