"""The holder's lease table and the fault injector's block choice, on plain data."""

from __future__ import annotations

from connector.faults import chosen
from connector.leases import LeaseTable


def test_every_lease_ends_exactly_once() -> None:
    table = LeaseTable("w1")
    a = table.grant("w2", [1, 2], ttl_s=5, now=0.0)
    b = table.grant("w3", [3], ttl_s=1, now=0.0)
    assert table.active == 2 and table.pinned_blocks == 3
    assert table.release(a.lease_id, "done") is a
    assert table.release(a.lease_id, "done") is None  # a second release is not a second outcome
    assert [lease.lease_id for lease in table.expire(now=1.0)] == [b.lease_id]
    assert table.release(b.lease_id, "done") is None  # released after it expired: too late
    ended = table.take_ended()
    assert [(lease.lease_id, lease.outcome) for lease in ended] == [(a.lease_id, "done"), (b.lease_id, "expired")]
    assert table.take_ended() == [] and table.active == 0
    assert table.outcomes == {"done": 1, "expired": 1}


def test_extend_and_ttl_cap() -> None:
    table = LeaseTable("w1", max_ttl_s=10)
    lease = table.grant("w2", [1], ttl_s=1000, now=0.0)
    assert lease.expires_at == 10.0  # capped: a reader cannot pin blocks for ever
    assert table.extend(lease.lease_id, 5, now=8.0) and lease.expires_at == 13.0
    assert table.expire(now=12.9) == []
    assert table.expire(now=13.0) == [lease]
    assert not table.extend(lease.lease_id, 5, now=14.0)


def test_cancel_all_on_shutdown() -> None:
    table = LeaseTable("w1")
    table.grant("w2", [1], ttl_s=5, now=0.0)
    table.grant("w2", [2], ttl_s=5, now=0.0)
    assert len(table.cancel_all()) == 2
    assert {lease.outcome for lease in table.take_ended()} == {"cancelled"}


def test_lease_ids_are_unique_per_holder() -> None:
    table = LeaseTable("w1")
    ids = {table.grant("w2", [i], ttl_s=1, now=0).lease_id for i in range(100)}
    assert len(ids) == 100 and all(i.startswith("w1-") for i in ids)


def test_fault_choice_is_repeatable_and_near_the_fraction() -> None:
    picks = [chosen(7, "fail", block, 0.3) for block in range(2000)]
    assert picks == [chosen(7, "fail", block, 0.3) for block in range(2000)]
    assert 0.25 < sum(picks) / len(picks) < 0.35
    assert picks != [chosen(8, "fail", block, 0.3) for block in range(2000)]
    assert not any(chosen(7, "fail", block, 0.0) for block in range(100))
    assert all(chosen(7, "fail", block, 1.0) for block in range(100))
