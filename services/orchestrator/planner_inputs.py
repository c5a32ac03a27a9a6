"""The planner's `ClusterSnapshot` from what the orchestrator hears (pure).

Inputs: the members (active prefill and decode workers; `both` workers and cordoned or
draining ones are not the planner's to move), each member's load snapshots over the
window, and the request records of the window reduced to `RecordSample`s.

- prefill: TTFT p90 of the window's records; prompt-token demand is the rate at which the
  prefill workers' uncached prompt tokens grew over the window (first to last snapshot),
  capacity `prefill_capacity_tok_s` per worker, or where that is 0 what each worker was
  measured to compute while it had prompt tokens waiting (`busy_prefill_rate`, remembered
  by the caller; a worker never measured counts as the mean of those that were; none
  measured: unknown, so the planner leaves the capacity terms out); a worker's load is its
  pending prefill tokens;
- decode: ITL p90 of the window's records ((duration - TTFT) / (completion tokens - 1), the
  mean gap of one request), batch occupancy (running / max_num_seqs over the decode
  workers, latest snapshots); a worker's load is its running sequences;
- both: KV usage of the fullest worker (latest snapshot);
- after an action (`since`), only records of requests that arrived after it count: the ones
  that queued before it show the old split's backlog, not the new split;
- queue time p90 per role, from the records' `queue_s` (the router's wait from arrival until
  the request was routed): a disaggregated request queued for its prefill worker, a single
  one for the worker that served it (its role as the members say now). Records without one
  (refused, or from a router that does not send it) count for neither.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

from services.orchestrator.planning import ClusterSnapshot, OperatorTouch, RoleLoad, WorkerLoad
from shared.schemas import LoadSnapshot, RequestRecord, WorkerRegistration, WorkerRole, WorkerStatus


@dataclass(frozen=True, slots=True)
class RecordSample:
    at: float  # when the orchestrator heard it (its clock)
    ttft_ms: float | None
    itl_ms: float | None
    queue_ms: float | None = None  # the router's queue time (None: the record has none)
    flow: str = ""  # "single" | "disaggregated"
    worker_id: str | None = None  # the worker that served it (a single flow's queue is that worker's role's)
    arrived_at: float | None = None  # when the request arrived (the same clock as `at`: heard less its duration)


def sample(record: RequestRecord, at: float) -> RecordSample | None:
    """The latency figures of one finished request (None: it failed or has none)."""
    if record.outcome != "ok" or record.ttft_s is None:
        return None
    itl_ms = None
    if record.completion_tokens > 1:
        itl_ms = max(0.0, record.duration_s - record.ttft_s) / (record.completion_tokens - 1) * 1000.0
    queue_ms = record.queue_s * 1000.0 if record.queue_s is not None else None
    return RecordSample(at=at, ttft_ms=record.ttft_s * 1000.0, itl_ms=itl_ms, queue_ms=queue_ms, flow=record.flow,
                        worker_id=record.worker_id, arrived_at=at - record.duration_s)


def p90(values: Sequence[float]) -> float:
    """The 90th percentile (nearest rank); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def planned_workers(members: Mapping[str, WorkerRegistration], role: WorkerRole | None = None) -> list[str]:
    """The active workers of `role` (None: of both planned roles)."""
    roles = (WorkerRole.PREFILL, WorkerRole.DECODE) if role is None else (role,)
    return sorted(worker_id for worker_id, registration in members.items()
                  if registration.role in roles and registration.status is WorkerStatus.ACTIVE)


def _latest(history: Sequence[LoadSnapshot]) -> LoadSnapshot | None:
    return history[-1] if history else None


def _kv_usage(snapshots: list[LoadSnapshot]) -> float:
    return max((s.kv_used_blocks / s.kv_total_blocks for s in snapshots if s.kv_total_blocks > 0), default=0.0)


def _uncached_rate(history: Sequence[LoadSnapshot]) -> float:
    if len(history) < 2 or history[-1].ts <= history[0].ts:
        return 0.0
    first, last = history[0], history[-1]
    grown = (last.prompt_tokens_total - last.cached_tokens_total) - (first.prompt_tokens_total
                                                                     - first.cached_tokens_total)
    return max(0.0, grown) / (last.ts - first.ts)


MIN_BUSY_S = 2.0  # a worker busy for less of the window gives no capacity figure (one prefill's lumps)


def busy_prefill_rate(history: Sequence[LoadSnapshot]) -> float | None:
    """Prompt tokens per second the worker computed between snapshots that both found prompt
    tokens waiting on it (busy all along: its capacity, not the demand); None when it was
    busy for under `MIN_BUSY_S` or computed nothing meanwhile."""
    busy_s, computed = 0.0, 0
    for before, after in pairwise(history):
        if before.pending_prefill_tokens > 0 and after.pending_prefill_tokens > 0 and after.ts > before.ts:
            busy_s += after.ts - before.ts
            computed += after.computed_prompt_tokens_total - before.computed_prompt_tokens_total
    if busy_s < MIN_BUSY_S or computed <= 0:
        return None
    return computed / busy_s


def measured_prefill_rates(members: Mapping[str, WorkerRegistration],
                           loads: Mapping[str, Sequence[LoadSnapshot]]) -> dict[str, float]:
    """`busy_prefill_rate` of each active prefill worker busy long enough in the window."""
    rates = {w: busy_prefill_rate(loads.get(w, ())) for w in planned_workers(members, WorkerRole.PREFILL)}
    return {w: rate for w, rate in rates.items() if rate is not None}


def _prefill_capacity(prefill_ids: list[str], configured_tok_s: float, measured: Mapping[str, float]) -> float:
    """The prefill role's capacity, all workers together (0.0: unknown)."""
    if configured_tok_s > 0:
        return configured_tok_s * len(prefill_ids)
    known = [measured[w] for w in prefill_ids if w in measured]
    if not known:
        return 0.0
    mean = sum(known) / len(known)
    return sum(measured.get(w, mean) for w in prefill_ids)


def build_snapshot(members: Mapping[str, WorkerRegistration], loads: Mapping[str, Sequence[LoadSnapshot]],
                   samples: Sequence[RecordSample], touches: Sequence[OperatorTouch], *,
                   prefill_capacity_tok_s: float, measured_prefill_tok_s: Mapping[str, float] | None = None,
                   paused: str = "", since: float | None = None) -> ClusterSnapshot:
    """`since`: the planner's last action; the latency figures leave out requests that arrived
    before it (they queued on the cluster as it was: a backlog the action's capacity is
    draining, which would make the role look as hot as before the action)."""
    if since is not None:
        samples = [s for s in samples if s.arrived_at is None or s.arrived_at >= since]
    prefill_ids = planned_workers(members, WorkerRole.PREFILL)
    decode_ids = planned_workers(members, WorkerRole.DECODE)
    prefill_latest = [s for s in (_latest(loads.get(w, ())) for w in prefill_ids) if s is not None]
    decode_latest = [s for s in (_latest(loads.get(w, ())) for w in decode_ids) if s is not None]

    def worker_load(worker_id: str, prefill: bool) -> WorkerLoad:
        latest = _latest(loads.get(worker_id, ()))
        if latest is None:
            return WorkerLoad(worker_id=worker_id)
        return WorkerLoad(worker_id=worker_id, load=float(latest.pending_prefill_tokens if prefill else latest.running))

    def queue_p90(ids: list[str], disaggregated: bool) -> float:
        return p90([s.queue_ms for s in samples if s.queue_ms is not None and (
            (disaggregated and s.flow == "disaggregated") or (s.flow == "single" and s.worker_id in ids))])

    slots = sum(members[w].capacity.max_num_seqs for w in decode_ids if _latest(loads.get(w, ())) is not None)
    prefill = RoleLoad(
        workers=[worker_load(w, True) for w in prefill_ids],
        ttft_p90_ms=p90([s.ttft_ms for s in samples if s.ttft_ms is not None]),
        queue_time_p90_ms=queue_p90(prefill_ids, True),
        prefill_demand_tok_s=sum(_uncached_rate(loads.get(w, ())) for w in prefill_ids),
        prefill_capacity_tok_s=_prefill_capacity(prefill_ids, prefill_capacity_tok_s, measured_prefill_tok_s or {}),
        kv_usage=_kv_usage(prefill_latest))
    decode = RoleLoad(
        workers=[worker_load(w, False) for w in decode_ids],
        itl_p90_ms=p90([s.itl_ms for s in samples if s.itl_ms is not None]),
        queue_time_p90_ms=queue_p90(decode_ids, False),
        decode_occupancy=sum(s.running for s in decode_latest) / slots if slots else 0.0,
        kv_usage=_kv_usage(decode_latest))
    return ClusterSnapshot(prefill=prefill, decode=decode, operator_touches=list(touches), paused=paused)
