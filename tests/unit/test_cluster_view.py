"""ClusterView: load, KV and request events folded into a per-worker and cluster view."""

from __future__ import annotations

import msgspec
import pytest

from services.metrics.cluster_view import ClusterView
from shared import schemas


def registration(worker_id: str, role: schemas.WorkerRole = schemas.WorkerRole.DECODE,
                 started_at: float = 1.0) -> schemas.WorkerRegistration:
    return schemas.WorkerRegistration(
        worker_id=worker_id, role=role, model="tiny", engine="sim", block_size=4, compat_hash="c",
        capacity=schemas.WorkerCapacity(kv_blocks=100, max_num_seqs=8, max_model_len=2048),
        started_at=started_at, heartbeat_at=started_at)


def load(worker_id: str, *, seq: int = 1, running: int = 0, waiting: int = 0, used: int = 0,
         total: int = 100, prompt: int = 0, cached: int = 0) -> schemas.LoadSnapshot:
    return schemas.LoadSnapshot(worker_id=worker_id, seq=seq, ts=0.0, running=running, waiting=waiting,
                        kv_total_blocks=total, kv_used_blocks=used, kv_cached_blocks=used,
                        prompt_tokens_total=prompt, cached_tokens_total=cached,
                        generated_tokens_total=0, pending_prefill_tokens=0)


def stored(*hashes: int) -> schemas.BlockStored:
    return schemas.BlockStored(block_hashes=list(hashes), parent_block_hash=None,
                       token_ids=[0] * 4 * len(hashes), block_size=4)


def batch(worker_id: str, seq: int, *events) -> schemas.KvEventBatch:  # type: ignore[no-untyped-def]
    return schemas.KvEventBatch(worker_id=worker_id, seq=seq, ts=0.0, events=list(events))


def record(outcome: str = "ok", ttft_s: float | None = 0.1) -> schemas.RequestRecord:
    return schemas.RequestRecord(request_id="r", model="tiny", worker_id="w1", outcome=outcome,
                         finish_reason="length", prompt_tokens=10, cached_tokens=4,
                         completion_tokens=5, ttft_s=ttft_s, duration_s=0.5)


@pytest.fixture
def view() -> ClusterView:
    view = ClusterView()
    view.apply_registration(registration("w1", schemas.WorkerRole.PREFILL))
    view.apply_registration(registration("w2", schemas.WorkerRole.DECODE))
    return view


def test_load_gives_usage_queue_and_hit_rate(view: ClusterView) -> None:
    view.apply_load(load("w1", running=3, waiting=2, used=25, prompt=200, cached=50))
    view.apply_load(load("w2", running=1, waiting=0, used=75, total=100))
    snapshot = view.snapshot()
    w1, w2 = snapshot.workers
    assert (w1.worker_id, w1.role, w1.running, w1.waiting) == ("w1", "prefill", 3, 2)
    assert w1.kv_usage == pytest.approx(0.25)
    assert w1.prefix_hit_rate == pytest.approx(0.25)
    assert w2.prefix_hit_rate is None  # no prompt tokens yet: undefined, not 0
    assert snapshot.totals.running == 4 and snapshot.totals.waiting == 2
    assert snapshot.totals.kv_usage == pytest.approx(0.5)
    assert snapshot.totals.prefix_hit_rate == pytest.approx(0.25)
    assert snapshot.by_role["decode"].kv_usage == pytest.approx(0.75)
    assert msgspec.json.decode(msgspec.json.encode(snapshot))["totals"]["workers"] == 2


def test_worker_without_load_yet_shows_zeros(view: ClusterView) -> None:
    w1 = view.snapshot().workers[0]
    assert (w1.load_seq, w1.kv_usage, w1.running) == (None, 0.0, 0)


def test_kv_events_count_stored_blocks(view: ClusterView) -> None:
    assert view.apply_kv(batch("w1", 0, schemas.AllBlocksCleared(), stored(1, 2, 3))) is False
    assert view.apply_kv(batch("w1", 1, stored(3, 4), schemas.BlockRemoved(block_hashes=[1, 99]))) is False
    w1 = view.snapshot().workers[0]
    assert (w1.kv_stored_blocks, w1.kv_seq, w1.kv_synced, w1.kv_gaps) == (3, 1, True, 0)
    assert view.apply_kv(batch("w1", 2, schemas.AllBlocksCleared())) is False
    assert view.snapshot().workers[0].kv_stored_blocks == 0


def test_gap_asks_for_resync_until_a_snapshot_arrives(view: ClusterView) -> None:
    view.apply_kv(batch("w1", 0, schemas.AllBlocksCleared(), stored(1)))
    assert view.apply_kv(batch("w1", 3, stored(2))) is True  # batches 1 and 2 were lost
    assert view.apply_kv(batch("w1", 4, stored(3))) is False  # in order after the gap: no repeat
    w1 = view.snapshot().workers[0]
    assert (w1.kv_synced, w1.kv_gaps) == (False, 1)
    # The worker answers with a snapshot: cleared, then everything it holds.
    assert view.apply_kv(batch("w1", 5, schemas.AllBlocksCleared(), stored(1, 2, 3, 5))) is False
    w1 = view.snapshot().workers[0]
    assert (w1.kv_synced, w1.kv_stored_blocks) == (True, 4)


def test_first_batch_of_a_stream_needs_no_resync(view: ClusterView) -> None:
    assert view.apply_kv(batch("w1", 1, stored(1))) is False  # workers number batches from 1
    assert view.snapshot().workers[0].kv_synced is True


def test_first_contact_mid_stream_and_restarted_stream_resync(view: ClusterView) -> None:
    assert view.apply_kv(batch("w1", 42, stored(1))) is True  # history unknown
    assert view.snapshot().workers[0].kv_gaps == 0  # not a gap, just late to the party
    assert view.apply_kv(batch("w1", 43, stored(2))) is False
    assert view.apply_kv(batch("w1", 0, stored(3))) is True  # sequence went backwards
    assert view.snapshot().workers[0].kv_gaps == 1


def test_removed_and_unknown_workers_are_dropped(view: ClusterView) -> None:
    view.apply_load(load("w2", running=5))
    assert view.remove_worker("w2") is True
    view.apply_load(load("w2", running=7))  # late message after the worker left
    assert view.apply_kv(batch("ghost", 5, stored(1))) is False
    assert view.worker_ids == ["w1"]
    assert view.snapshot().dropped_unknown_worker == 2


def test_reregistration_after_restart_resets_the_worker(view: ClusterView) -> None:
    view.apply_kv(batch("w1", 0, schemas.AllBlocksCleared(), stored(1, 2)))
    view.apply_registration(registration("w1", schemas.WorkerRole.PREFILL, started_at=1.0))  # heartbeat
    assert view.snapshot().workers[0].kv_stored_blocks == 2
    view.apply_registration(registration("w1", schemas.WorkerRole.PREFILL, started_at=2.0))  # new process
    w1 = view.snapshot().workers[0]
    assert (w1.kv_stored_blocks, w1.kv_seq) == (0, None)


def test_request_records(view: ClusterView) -> None:
    view.apply_request(record("ok", ttft_s=0.1))
    view.apply_request(record("ok", ttft_s=0.3))
    view.apply_request(record("timeout", ttft_s=None))
    requests = view.snapshot().requests
    assert requests.by_outcome == {"ok": 2, "timeout": 1}
    assert requests.ttft_mean_s == pytest.approx(0.2)
    assert (requests.prompt_tokens, requests.cached_tokens, requests.completion_tokens) == (30, 12, 15)
