"""The planner's snapshot from members, load snapshots and request records (pure)."""

from __future__ import annotations

from collections import deque

import pytest

from services.orchestrator.planner_inputs import (
    MIN_BUSY_S,
    build_snapshot,
    busy_prefill_rate,
    measured_prefill_rates,
    p90,
    planned_workers,
    sample,
)
from services.orchestrator.planning import OperatorTouch, Slos, Thresholds
from services.orchestrator.planning.signals import role_pressure
from shared.schemas import LoadSnapshot, RequestRecord, WorkerCapacity, WorkerRegistration, WorkerRole, WorkerStatus


def member(worker_id: str, role: WorkerRole, status: WorkerStatus = WorkerStatus.ACTIVE) -> WorkerRegistration:
    return WorkerRegistration(worker_id=worker_id, role=role, model="m", engine="sim", block_size=16, compat_hash="h",
                              capacity=WorkerCapacity(kv_blocks=100, max_num_seqs=8, max_model_len=2048),
                              status=status, started_at=0.0, heartbeat_at=0.0)


def load(worker_id: str, ts: float, *, running: int = 0, used: int = 0, prompt: int = 0, cached: int = 0,
         pending: int = 0, computed: int = 0) -> LoadSnapshot:
    return LoadSnapshot(worker_id=worker_id, seq=int(ts), ts=ts, running=running, waiting=0, kv_total_blocks=100,
                        kv_used_blocks=used, kv_cached_blocks=0, prompt_tokens_total=prompt,
                        cached_tokens_total=cached, generated_tokens_total=0, pending_prefill_tokens=pending,
                        computed_prompt_tokens_total=computed)


def record(ttft_s: float | None, duration_s: float, completion: int, outcome: str = "ok") -> RequestRecord:
    return RequestRecord(request_id="r", model="m", worker_id="d", outcome=outcome, finish_reason="length",
                         prompt_tokens=10, cached_tokens=0, completion_tokens=completion, ttft_s=ttft_s,
                         duration_s=duration_s)


def test_a_record_gives_its_ttft_and_mean_inter_token_gap() -> None:
    figures = sample(record(0.2, 1.2, 11), at=5.0)
    assert figures is not None and figures.ttft_ms == pytest.approx(200) and figures.itl_ms == pytest.approx(100)
    assert sample(record(0.2, 0.2, 1), at=5.0).itl_ms is None  # one token: no gap
    assert sample(record(None, 1.0, 0, outcome="overloaded"), at=5.0) is None


def test_p90_is_the_nearest_rank() -> None:
    assert p90([]) == 0.0
    assert p90([float(v) for v in range(1, 11)]) == 9.0
    assert p90([5.0]) == 5.0


def test_the_snapshot_reads_each_role() -> None:
    members = {"p1": member("p1", WorkerRole.PREFILL), "p2": member("p2", WorkerRole.PREFILL),
               "d1": member("d1", WorkerRole.DECODE), "b1": member("b1", WorkerRole.BOTH),
               "d2": member("d2", WorkerRole.DECODE, WorkerStatus.CORDONED)}
    assert planned_workers(members) == ["d1", "p1", "p2"]
    loads = {"p1": [load("p1", 0.0, prompt=1000, cached=200), load("p1", 2.0, prompt=3000, cached=200, pending=64,
                                                                     used=30)],
             "p2": [load("p2", 1.0)],
             "d1": [load("d1", 2.0, running=6, used=70)]}
    samples = [s for s in (sample(record(t / 10, t / 10 + 0.5, 6), at=1.0) for t in range(1, 11)) if s is not None]
    touch = OperatorTouch(worker_id="p2", at=1.0, command="CordonWorker")
    snapshot = build_snapshot(members, loads, samples, [touch], prefill_capacity_tok_s=500.0)
    assert [w.worker_id for w in snapshot.prefill.workers] == ["p1", "p2"]
    assert snapshot.prefill.workers[0].load == 64
    assert snapshot.prefill.prefill_demand_tok_s == pytest.approx(1000.0)  # 2000 uncached tokens in 2 s
    assert snapshot.prefill.prefill_capacity_tok_s == 1000.0
    assert snapshot.prefill.ttft_p90_ms == pytest.approx(900)
    assert snapshot.prefill.kv_usage == pytest.approx(0.3)
    assert [w.worker_id for w in snapshot.decode.workers] == ["d1"] and snapshot.decode.workers[0].load == 6
    assert snapshot.decode.decode_occupancy == pytest.approx(6 / 8)
    assert snapshot.decode.itl_p90_ms == pytest.approx(100)
    assert snapshot.decode.kv_usage == pytest.approx(0.7)
    assert snapshot.operator_touches == [touch]


def test_queue_times_from_the_records_go_to_the_role_that_queued() -> None:
    import msgspec

    from services.orchestrator.planning import Slos, Thresholds
    from services.orchestrator.planning.signals import role_pressure

    members = {"p1": member("p1", WorkerRole.PREFILL), "d1": member("d1", WorkerRole.DECODE),
               "b1": member("b1", WorkerRole.BOTH)}
    loads = {"p1": [load("p1", 0.0)], "d1": [load("d1", 0.0)]}

    def queued(queue_s: float | None, flow: str, worker_id: str) -> RequestRecord:
        return msgspec.structs.replace(record(0.5, 1.5, 11), queue_s=queue_s, flow=flow, worker_id=worker_id)

    records = [queued(q / 100, "disaggregated", "d1") for q in range(1, 11)]  # 10..100 ms before prefill
    records += [queued(0.3, "single", "d1"), queued(0.2, "single", "d1")]  # served whole by the decode worker
    records += [queued(5.0, "single", "b1"),  # a `both` worker's: not planned
                queued(None, "disaggregated", "d1")]  # an older router's record: no queue time
    samples = [s for s in (sample(r, at=1.0) for r in records) if s is not None]
    assert samples[0].queue_ms == pytest.approx(10) and samples[-1].queue_ms is None
    snapshot = build_snapshot(members, loads, samples, [], prefill_capacity_tok_s=0.0)
    assert snapshot.prefill.queue_time_p90_ms == pytest.approx(90)
    assert snapshot.decode.queue_time_p90_ms == pytest.approx(300)
    slos = Slos(ttft_p90_ms=1000, itl_p90_ms=200)
    assert "(queue p90 90 ms)" in role_pressure(WorkerRole.PREFILL, snapshot.prefill, slos, Thresholds()).why
    assert "(queue p90 300 ms)" in role_pressure(WorkerRole.DECODE, snapshot.decode, slos, Thresholds()).why
    # a record from before the field existed decodes, without a queue time
    old = msgspec.json.encode({k: v for k, v in msgspec.to_builtins(record(0.5, 1.5, 11)).items() if k != "queue_s"})
    assert msgspec.json.decode(old, type=RequestRecord).queue_s is None


def test_after_an_action_only_requests_that_arrived_since_count() -> None:
    members = {"p1": member("p1", WorkerRole.PREFILL), "d1": member("d1", WorkerRole.DECODE)}
    loads = {"p1": [load("p1", 0.0)], "d1": [load("d1", 0.0)]}
    # heard at 100 s: one queued 3 s before the action at 98 s (TTFT 3 s), one arrived after it (TTFT 0.4 s)
    backlog, fresh = sample(record(3.0, 4.0, 11), at=100.0), sample(record(0.4, 1.4, 11), at=100.0)
    assert backlog is not None and fresh is not None and backlog.arrived_at == 96.0
    everything = build_snapshot(members, loads, [backlog, fresh], [], prefill_capacity_tok_s=0.0)
    assert everything.prefill.ttft_p90_ms == pytest.approx(3000)
    since = build_snapshot(members, loads, [backlog, fresh], [], prefill_capacity_tok_s=0.0, since=98.0)
    assert since.prefill.ttft_p90_ms == pytest.approx(400) and since.decode.itl_p90_ms == pytest.approx(100)


def test_a_busy_workers_prefill_rate_is_what_it_computed_while_prompts_waited() -> None:
    history = [load("p1", 0.0, pending=900, computed=0), load("p1", 1.0, pending=800, computed=1000),
               load("p1", 2.0, pending=0, computed=1500),  # ran dry in here: neither this interval
               load("p1", 3.0, pending=0, computed=1500),  # nor this one says what it can do
               load("p1", 4.0, pending=2000, computed=1500), load("p1", 6.0, pending=1000, computed=3500)]
    assert busy_prefill_rate(history) == pytest.approx((1000 + 2000) / 3.0)  # 3 busy seconds
    assert busy_prefill_rate(deque(history)) == busy_prefill_rate(history)  # the loop keeps a deque
    assert busy_prefill_rate(history[:2]) is None  # busy for under MIN_BUSY_S
    assert MIN_BUSY_S > 1.0
    assert busy_prefill_rate([load("p1", t, pending=0, computed=0) for t in range(5)]) is None  # idle


def test_a_measured_capacity_stands_in_for_an_unset_one_and_shows_the_queue_before_any_ttft() -> None:
    members = {"p1": member("p1", WorkerRole.PREFILL), "p2": member("p2", WorkerRole.PREFILL),
               "d1": member("d1", WorkerRole.DECODE)}
    loads = {"p1": [load("p1", 0.0, pending=3000, computed=0), load("p1", 3.0, pending=3000, computed=1500)],
             "p2": [load("p2", 3.0, pending=3000)], "d1": [load("d1", 3.0, running=1)]}
    measured = measured_prefill_rates(members, loads)
    assert measured == {"p1": pytest.approx(500.0)}  # p2 never measured: counted as the mean of those that were
    snapshot = build_snapshot(members, loads, [], [], prefill_capacity_tok_s=0.0, measured_prefill_tok_s=measured)
    assert snapshot.prefill.prefill_capacity_tok_s == pytest.approx(1000.0)
    # no request has ended yet (TTFT p90 0), but 6000 queued tokens take 6 s at 1000 tok/s: 3x a 2 s SLO
    pressure = role_pressure(WorkerRole.PREFILL, snapshot.prefill, Slos(ttft_p90_ms=2000, itl_p90_ms=50),
                             Thresholds())
    assert pressure.latency == pytest.approx(3.0) and "6000 queued prompt tokens" in pressure.why
    unknown = build_snapshot(members, loads, [], [], prefill_capacity_tok_s=0.0)
    assert unknown.prefill.prefill_capacity_tok_s == 0.0  # nothing measured, nothing configured: left out
    assert role_pressure(WorkerRole.PREFILL, unknown.prefill, Slos(ttft_p90_ms=2000, itl_p90_ms=50),
                         Thresholds()).latency == 0.0
