"""MembershipTable: joins, updates, expiries and deregistrations, with plain data."""

from __future__ import annotations

from services.orchestrator.membership import MembershipTable
from shared.schemas import WorkerCapacity, WorkerRegistration, WorkerRole, WorkerStatus


def registration(worker_id: str = "w1", *, role: WorkerRole = WorkerRole.DECODE,
                 status: WorkerStatus = WorkerStatus.ACTIVE, started_at: float = 100.0,
                 heartbeat_at: float = 100.0) -> WorkerRegistration:
    return WorkerRegistration(
        worker_id=worker_id, role=role, model="tiny", engine="sim", block_size=16,
        compat_hash="abc", capacity=WorkerCapacity(kv_blocks=64, max_num_seqs=8, max_model_len=2048),
        status=status, started_at=started_at, heartbeat_at=heartbeat_at)


def kinds(table: MembershipTable) -> list[tuple[str, str, str]]:
    return [(change.kind, change.worker_id, change.reason) for change in table.take_changes()]


def test_first_heartbeat_joins_and_repeats_are_silent() -> None:
    table = MembershipTable(ttl_s=1.0)
    table.observe(registration(), now=0.0)
    table.observe(registration(heartbeat_at=100.5), now=0.5)
    assert kinds(table) == [("joined", "w1", "registered")]
    assert kinds(table) == []  # drained
    assert set(table.members) == {"w1"}
    assert table.last_seen("w1") == 0.5


def test_status_and_role_changes_are_updates() -> None:
    table = MembershipTable(ttl_s=1.0)
    table.observe(registration(), now=0.0)
    table.observe(registration(status=WorkerStatus.DRAINING), now=0.1)
    table.observe(registration(status=WorkerStatus.DRAINING, role=WorkerRole.PREFILL), now=0.2)
    changes = table.take_changes()
    assert [(c.kind, c.reason) for c in changes] == [
        ("joined", "registered"), ("updated", "draining"), ("updated", "role_changed")]
    assert changes[-1].registration is not None and changes[-1].registration.role == WorkerRole.PREFILL


def test_sweep_removes_only_silent_workers() -> None:
    table = MembershipTable(ttl_s=1.0)
    table.observe(registration("w1"), now=0.0)
    table.observe(registration("w2"), now=0.0)
    table.take_changes()
    table.observe(registration("w2", heartbeat_at=101.0), now=0.9)
    assert table.sweep(now=1.0) == []  # exactly ttl is not yet expired
    removed = table.sweep(now=1.5)
    assert [(c.kind, c.worker_id, c.reason) for c in removed] == [("removed", "w1", "heartbeat_lost")]
    assert kinds(table) == [("removed", "w1", "heartbeat_lost")]  # also buffered for publishing
    assert set(table.members) == {"w2"}
    assert removed[0].registration is not None  # consumers learn what left


def test_forget_is_a_deregistration_and_unknown_workers_are_ignored() -> None:
    table = MembershipTable(ttl_s=1.0)
    table.observe(registration(), now=0.0)
    table.forget("w1", now=0.1)
    table.forget("w1", now=0.2)  # e.g. the delete marker of a key the sweep already removed
    table.forget("never-seen", now=0.2)
    assert kinds(table) == [("joined", "w1", "registered"), ("removed", "w1", "deregistered")]
    assert table.sweep(now=10.0) == []


def test_swept_worker_that_comes_back_rejoins() -> None:
    table = MembershipTable(ttl_s=1.0)
    table.observe(registration(), now=0.0)
    table.sweep(now=2.0)
    table.observe(registration(heartbeat_at=103.0), now=3.0)
    assert kinds(table) == [("joined", "w1", "registered"), ("removed", "w1", "heartbeat_lost"),
                            ("joined", "w1", "registered")]


def test_restart_under_the_same_id_is_a_leave_and_a_join() -> None:
    table = MembershipTable(ttl_s=1.0)
    table.observe(registration(started_at=100.0), now=0.0)
    table.observe(registration(started_at=200.0), now=0.3)
    assert kinds(table) == [("joined", "w1", "registered"), ("removed", "w1", "restarted"),
                            ("joined", "w1", "registered")]


def test_restart_ttls_excuses_silence_the_observer_could_not_hear() -> None:
    table = MembershipTable(ttl_s=1.0)
    table.observe(registration(), now=0.0)
    table.restart_ttls(now=5.0)  # e.g. the orchestrator was disconnected until t=5
    assert table.sweep(now=5.5) == []
    assert [c.reason for c in table.sweep(now=6.5)] == ["heartbeat_lost"]
