"""Recent cluster activity over a sliding window: routing decisions, KV transfers, errors
and departed workers. Pure and clock-free: every call takes `now` (the collector's wall
clock, seconds), so rates are reproducible on plain data.

`ClusterView` owns one `RecentActivity` and feeds it request records (one per routed
request, naming the worker that served it), transfer records (one per KV hand-off, from
the reader) and departures from the members bucket; the live cluster page and
`tandem status` read its `summary(now)` through the collector's `/cluster` JSON.

Memory is bounded: events older than the window are dropped as new ones arrive and on
every summary, recent errors and departures are kept in fixed-length deques.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

import msgspec

from shared.schemas import RequestRecord, TransferRecord

OUTCOME_OK = "ok"
TRANSFER_DONE = "done"


class RecentError(msgspec.Struct, kw_only=True):
    at: float  # collector wall clock when it learned of the error
    kind: str  # "request" | "transfer" | "worker_lost"
    code: str  # the request's outcome, the transfer's outcome, or "heartbeat_lost"
    worker_id: str | None
    request_id: str | None = None
    peer_worker_id: str | None = None
    message: str = ""


class RecentRequest(msgspec.Struct, kw_only=True):
    """One routing decision as its record tells it: who served it and how it ended."""

    at: float
    request_id: str
    worker_id: str | None
    outcome: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float | None
    duration_s: float


class DepartedWorker(msgspec.Struct, kw_only=True):
    worker_id: str
    role: str
    left_at: float
    reason: str  # "drained" (deregistered after draining) | "lost" (heartbeat expired)


class WorkerActivity(msgspec.Struct, kw_only=True):
    """Per-worker rates over the window (per second)."""

    requests_per_s: float  # requests routed to the worker that ended
    transfers_in_per_s: float  # KV hand-offs the worker read (pull) or received (push)
    transfers_out_per_s: float  # KV hand-offs the worker was the peer of


class ActivitySummary(msgspec.Struct, kw_only=True):
    window_s: float
    requests_per_s: float
    transfers_per_s: float
    transfer_bytes_per_s: float
    requests_by_outcome: dict[str, int]  # in the window
    requests_by_worker: dict[str, int]  # routing decisions in the window, by serving worker
    transfers_by_outcome: dict[str, int]  # in the window
    workers: dict[str, WorkerActivity]  # every worker with activity in the window
    recent_requests: list[RecentRequest]  # newest first
    recent_errors: list[RecentError]  # newest first
    departed: list[DepartedWorker]  # newest first, left within `departed_keep_s`


@dataclass(frozen=True, slots=True)
class _RequestEvent:
    at: float
    worker_id: str | None
    outcome: str


@dataclass(frozen=True, slots=True)
class _TransferEvent:
    at: float
    reader: str
    holder: str
    outcome: str
    bytes: int


class RecentActivity:
    def __init__(self, *, window_s: float = 10.0, max_errors: int = 20, max_requests: int = 20,
                 departed_keep_s: float = 60.0, max_departed: int = 20) -> None:
        assert window_s > 0
        self.window_s = window_s
        self.departed_keep_s = departed_keep_s
        self._requests: deque[_RequestEvent] = deque()
        self._transfers: deque[_TransferEvent] = deque()
        self._recent_requests: deque[RecentRequest] = deque(maxlen=max_requests)
        self._errors: deque[RecentError] = deque(maxlen=max_errors)
        self._departed: deque[DepartedWorker] = deque(maxlen=max_departed)

    def record_request(self, record: RequestRecord, now: float) -> None:
        self._requests.append(_RequestEvent(now, record.worker_id, record.outcome))
        self._recent_requests.append(RecentRequest(
            at=now, request_id=record.request_id, worker_id=record.worker_id, outcome=record.outcome,
            prompt_tokens=record.prompt_tokens, cached_tokens=record.cached_tokens,
            completion_tokens=record.completion_tokens, ttft_s=record.ttft_s, duration_s=record.duration_s))
        if record.outcome != OUTCOME_OK:
            self._errors.append(RecentError(at=now, kind="request", code=record.outcome,
                                            worker_id=record.worker_id, request_id=record.request_id))
        self._prune(now)

    def record_transfer(self, record: TransferRecord, now: float) -> None:
        self._transfers.append(_TransferEvent(now, record.worker_id, record.peer_worker_id, record.outcome,
                                              record.bytes))
        if record.outcome != TRANSFER_DONE:
            self._errors.append(RecentError(
                at=now, kind="transfer", code=record.outcome, worker_id=record.worker_id,
                request_id=record.request_id, peer_worker_id=record.peer_worker_id,
                message=record.reason or f"{record.kind}: {record.blocks_ok}/{record.blocks} blocks"))
        self._prune(now)

    def record_departure(self, worker_id: str, role: str, now: float, *, drained: bool) -> None:
        """A worker left the members bucket: deregistered after draining, or expired."""
        self._departed.append(DepartedWorker(worker_id=worker_id, role=role, left_at=now,
                                             reason="drained" if drained else "lost"))
        if not drained:
            self._errors.append(RecentError(at=now, kind="worker_lost", code="heartbeat_lost", worker_id=worker_id,
                                            message="no heartbeat within the membership TTL"))

    def forget_departure(self, worker_id: str) -> None:
        """The worker is back (registered again): it is no longer a departed one."""
        kept = [departed for departed in self._departed if departed.worker_id != worker_id]
        self._departed.clear()
        self._departed.extend(kept)

    def summary(self, now: float) -> ActivitySummary:
        self._prune(now)
        window = self.window_s
        per_worker: dict[str, list[int]] = {}  # worker -> [requests, transfers in, transfers out]
        for request in self._requests:
            if request.worker_id:
                per_worker.setdefault(request.worker_id, [0, 0, 0])[0] += 1
        for transfer in self._transfers:
            per_worker.setdefault(transfer.reader, [0, 0, 0])[1] += 1
            if transfer.holder:
                per_worker.setdefault(transfer.holder, [0, 0, 0])[2] += 1
        by_worker = Counter(request.worker_id for request in self._requests if request.worker_id)
        return ActivitySummary(
            window_s=window,
            requests_per_s=len(self._requests) / window,
            transfers_per_s=len(self._transfers) / window,
            transfer_bytes_per_s=sum(transfer.bytes for transfer in self._transfers) / window,
            requests_by_outcome=dict(sorted(Counter(request.outcome for request in self._requests).items())),
            requests_by_worker=dict(sorted(by_worker.items())),
            transfers_by_outcome=dict(sorted(Counter(transfer.outcome for transfer in self._transfers).items())),
            workers={worker_id: WorkerActivity(requests_per_s=counts[0] / window,
                                               transfers_in_per_s=counts[1] / window,
                                               transfers_out_per_s=counts[2] / window)
                     for worker_id, counts in sorted(per_worker.items())},
            recent_requests=list(reversed(self._recent_requests)),
            recent_errors=list(reversed(self._errors)),
            departed=[departed for departed in reversed(self._departed)
                      if now - departed.left_at <= self.departed_keep_s],
        )

    def _prune(self, now: float) -> None:
        # Events arrive in clock order, so the oldest are at the left; a clock step back
        # only keeps an event a little longer.
        oldest = now - self.window_s
        for events in (self._requests, self._transfers):
            while events and events[0].at <= oldest:
                events.popleft()
