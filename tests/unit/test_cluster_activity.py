"""The cluster view's live parts on plain data: rates over the window, bounded recent errors,
departed workers, role grouping and the `/cluster` status that the cluster page reads."""

from __future__ import annotations

import msgspec
import pytest

from services.metrics.activity import RecentActivity
from services.metrics.cluster_view import ClusterStatus, ClusterView
from shared.schemas import RequestRecord, TransferRecord, WorkerRole, WorkerStatus
from tests.unit.test_cluster_view import load, registration


def request(worker_id: str | None = "w1", outcome: str = "ok", request_id: str = "r") -> RequestRecord:
    return RequestRecord(request_id=request_id, model="tiny", worker_id=worker_id, outcome=outcome,
                         finish_reason="length", prompt_tokens=10, cached_tokens=4, completion_tokens=5,
                         ttft_s=0.1, duration_s=0.5)


def transfer(reader: str = "w2", holder: str = "w1", outcome: str = "done", size: int = 1000,
             reason: str = "") -> TransferRecord:
    return TransferRecord(worker_id=reader, request_id="r", kind="pull", peer_worker_id=holder, outcome=outcome,
                          blocks=4, blocks_ok=4 if outcome == "done" else 1, bytes=size, duration_s=0.01,
                          pulled_tokens=16, recomputed_tokens=0, reason=reason)


def test_rates_count_only_the_window() -> None:
    activity = RecentActivity(window_s=10.0)
    for at in (100.0, 101.0, 105.0, 109.0):
        activity.record_request(request("w1"), now=at)
    activity.record_request(request("w2"), now=109.5)
    activity.record_transfer(transfer(size=2000), now=104.0)
    summary = activity.summary(now=110.0)
    assert summary.requests_per_s == pytest.approx(4 / 10)  # the one at 100.0 is out of (100, 110]
    assert summary.requests_by_worker == {"w1": 3, "w2": 1}
    assert summary.workers["w1"].requests_per_s == pytest.approx(0.3)
    assert summary.workers["w2"].transfers_in_per_s == pytest.approx(0.1)
    assert summary.workers["w1"].transfers_out_per_s == pytest.approx(0.1)
    assert summary.transfer_bytes_per_s == pytest.approx(200.0)
    later = activity.summary(now=200.0)
    assert (later.requests_per_s, later.transfers_per_s, later.workers) == (0.0, 0.0, {})
    assert later.requests_by_outcome == {}


def test_recent_errors_are_bounded_newest_first() -> None:
    activity = RecentActivity(max_errors=3)
    for index in range(5):
        activity.record_request(request(outcome="worker_lost", request_id=f"r{index}"), now=float(index))
    activity.record_request(request(outcome="ok"), now=5.0)  # not an error
    activity.record_transfer(transfer(outcome="failed", reason="checksum mismatch"), now=6.0)
    errors = activity.summary(now=6.0).recent_errors
    assert [(error.kind, error.request_id) for error in errors] == [
        ("transfer", "r"), ("request", "r4"), ("request", "r3")]
    assert errors[0].code == "failed" and errors[0].message == "checksum mismatch"
    assert errors[0].peer_worker_id == "w1" and errors[1].code == "worker_lost"


def test_recent_requests_show_routing_decisions_bounded() -> None:
    activity = RecentActivity(max_requests=2)
    for index in range(3):
        activity.record_request(request(worker_id=f"w{index}", request_id=f"r{index}"), now=float(index))
    recent = activity.summary(now=3.0).recent_requests
    assert [(item.request_id, item.worker_id) for item in recent] == [("r2", "w2"), ("r1", "w1")]


def test_departed_workers_kept_for_a_while_and_lost_ones_are_errors() -> None:
    activity = RecentActivity(departed_keep_s=30.0)
    activity.record_departure("w1", "decode", now=10.0, drained=False)
    activity.record_departure("w2", "prefill", now=20.0, drained=True)
    summary = activity.summary(now=35.0)
    assert [(gone.worker_id, gone.reason) for gone in summary.departed] == [("w2", "drained"), ("w1", "lost")]
    assert [(error.kind, error.worker_id) for error in summary.recent_errors] == [("worker_lost", "w1")]
    assert [gone.worker_id for gone in activity.summary(now=45.0).departed] == ["w2"]
    activity.forget_departure("w2")
    assert activity.summary(now=45.0).departed == []


def test_view_groups_workers_by_role_in_role_order() -> None:
    view = ClusterView()
    for worker_id, role in (("d2", WorkerRole.DECODE), ("b1", WorkerRole.BOTH), ("p1", WorkerRole.PREFILL),
                            ("d1", WorkerRole.DECODE)):
        view.apply_registration(registration(worker_id, role))
    view.apply_load(load("d1", running=2, used=50))
    view.apply_load(load("d2", used=0))
    status = view.status(now=1.0)
    assert [(group.role, group.worker_ids) for group in status.roles] == [
        ("prefill", ["p1"]), ("decode", ["d1", "d2"]), ("both", ["b1"])]
    decode = status.roles[1].totals
    assert (decode.workers, decode.running, decode.kv_usage) == (2, 2, pytest.approx(0.25))
    assert [(worker.engine, worker.compat_hash) for worker in status.workers][0] == ("sim", "c")


def test_view_records_how_a_worker_left() -> None:
    view = ClusterView()
    view.apply_registration(registration("w1"))
    draining = registration("w2")
    view.apply_registration(draining)
    view.apply_registration(msgspec.structs.replace(draining, status=WorkerStatus.DRAINING))
    view.remove_worker("w1", now=5.0)
    view.remove_worker("w2", now=6.0)
    view.remove_worker("w3", now=7.0)  # never known: nothing to list
    status = view.status(now=8.0)
    assert status.workers == []
    assert [(gone.worker_id, gone.role, gone.reason) for gone in status.activity.departed] == [
        ("w2", "decode", "drained"), ("w1", "decode", "lost")]
    view.apply_registration(registration("w1", started_at=9.0))  # back under the same id
    assert [gone.worker_id for gone in view.status(now=9.0).activity.departed] == ["w2"]


def test_status_encodes_to_json_and_decodes_typed() -> None:
    view = ClusterView()
    view.apply_registration(registration("w1", WorkerRole.PREFILL))
    view.apply_request(request("w1"), now=1.0)
    view.apply_request(request("w1", outcome="no_workers"), now=2.0)
    view.apply_transfer(transfer(reader="w1", holder="w9"), now=2.0)
    encoded = msgspec.json.encode(view.status(now=3.0))
    status = msgspec.json.decode(encoded, type=ClusterStatus)
    assert status.now == 3.0 and status.roles[0].worker_ids == ["w1"]
    assert status.activity.requests_by_outcome == {"no_workers": 1, "ok": 1}
    assert status.requests.by_outcome == {"no_workers": 1, "ok": 1}  # the totals still count both
    assert status.activity.transfers_by_outcome == {"done": 1}
    # a request without `now` counts in the totals only
    view.apply_request(request("w1"))
    assert view.status(now=3.0).activity.requests_per_s == pytest.approx(2 / view.activity.window_s)
