"""SequenceTracker on plain data: in order, late start, gap, stale, resync, forget."""

from __future__ import annotations

from shared.cluster.sequence import SeqOrder, SequenceTracker, SyncState


def steps(tracker: SequenceTracker, worker_id: str, *seqs: int) -> list[tuple[SeqOrder, bool, bool]]:
    return [(step.order, step.synced, step.resync_needed)
            for step in (tracker.observe(worker_id, seq) for seq in seqs)]


def test_a_stream_heard_from_its_first_message_is_in_sync() -> None:
    tracker = SequenceTracker()
    assert tracker.state("w") is SyncState.UNKNOWN and tracker.last_seq("w") is None
    assert steps(tracker, "w", 1, 2, 3) == [(SeqOrder.IN_ORDER, True, False)] * 3
    assert (tracker.state("w"), tracker.last_seq("w"), tracker.gaps("w")) == (SyncState.SYNCED, 3, 0)
    assert tracker.unsynced() == []


def test_a_gap_asks_for_one_resync_and_in_order_messages_do_not_heal_it() -> None:
    tracker = SequenceTracker()
    assert steps(tracker, "w", 1, 4, 5, 9) == [
        (SeqOrder.IN_ORDER, True, False),
        (SeqOrder.GAP, False, True),  # 2 and 3 were lost: ask once
        (SeqOrder.IN_ORDER, False, False),  # still out of sync until a snapshot
        (SeqOrder.GAP, False, False),  # already asked: the caller's timer asks again
    ]
    assert (tracker.gaps("w"), tracker.unsynced()) == (2, ["w"])


def test_a_message_with_the_whole_state_resyncs_whatever_its_number() -> None:
    tracker = SequenceTracker()
    steps(tracker, "w", 1, 7)
    step = tracker.observe("w", 20, resynced=True)
    assert (step.order, step.synced, step.resync_needed) == (SeqOrder.GAP, True, False)
    assert step.out_of_order
    assert (tracker.state("w"), tracker.gaps("w")) == (SyncState.SYNCED, 1)  # a resyncing gap is not counted
    assert steps(tracker, "w", 21) == [(SeqOrder.IN_ORDER, True, False)]


def test_joining_mid_stream_is_a_late_start_not_a_gap() -> None:
    tracker = SequenceTracker()
    assert steps(tracker, "w", 42, 43) == [(SeqOrder.LATE_START, False, True), (SeqOrder.IN_ORDER, False, False)]
    assert tracker.gaps("w") == 0
    snapshot_first = SequenceTracker().observe("v", 0, resynced=True)
    assert (snapshot_first.order, snapshot_first.synced) == (SeqOrder.LATE_START, True)


def test_a_duplicate_or_a_restarted_stream_is_stale_and_out_of_sync() -> None:
    tracker = SequenceTracker()
    assert steps(tracker, "w", 1, 2, 2, 1) == [
        (SeqOrder.IN_ORDER, True, False), (SeqOrder.IN_ORDER, True, False),
        (SeqOrder.STALE, False, True), (SeqOrder.STALE, False, False)]
    assert (tracker.gaps("w"), tracker.last_seq("w")) == (2, 1)


def test_a_consumer_found_inconsistency_loses_sync_in_order() -> None:
    tracker = SequenceTracker()
    tracker.observe("w", 1)
    step = tracker.observe("w", 2, lost=True)
    assert (step.order, step.synced, step.resync_needed) == (SeqOrder.IN_ORDER, False, True)
    assert tracker.gaps("w") == 0
    assert tracker.observe("w", 3, lost=True, resynced=True).synced  # the whole state wins


def test_forget_starts_a_worker_over_and_workers_are_independent() -> None:
    tracker = SequenceTracker()
    steps(tracker, "a", 1, 5)
    steps(tracker, "b", 1, 2)
    assert tracker.unsynced() == ["a"]
    tracker.forget("a")  # restarted or removed
    tracker.forget("never-seen")
    assert (tracker.state("a"), tracker.last_seq("a"), tracker.gaps("a")) == (SyncState.UNKNOWN, None, 0)
    assert steps(tracker, "a", 1) == [(SeqOrder.IN_ORDER, True, False)]
    assert tracker.unsynced() == [] and tracker.state("b") is SyncState.SYNCED
