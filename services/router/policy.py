"""Routing policy: which worker serves a request. Pure and synchronous.

Fed by `WorkerPool.views()` (the adapter); no I/O, no clock. Single-worker serving for
now: a request goes whole to one ACTIVE worker of its model whose role is BOTH or DECODE.

Load is *predicted*: the worker's last reported `running + waiting`, corrected by how
this router's own in-flight count on that worker changed since the report arrived. A
burst of requests landing between two load reports therefore spreads across workers
instead of piling onto the one that looked idle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.schemas.membership import WorkerRole, WorkerStatus

SERVING_ROLES = frozenset({WorkerRole.BOTH, WorkerRole.DECODE})


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What the policy knows about one worker at one instant."""

    worker_id: str
    model: str
    role: WorkerRole
    status: WorkerStatus
    max_num_seqs: int
    max_model_len: int
    reported_load: int | None  # running + waiting in the last load snapshot; None before one
    in_flight: int  # this router's requests on the worker now
    in_flight_at_report: int  # ... when that snapshot arrived
    last_routed: int  # this router's routing sequence number of its latest pick (0: never)

    @property
    def predicted_load(self) -> int:
        if self.reported_load is None:
            return self.in_flight
        # The report already counts the requests we had in flight when it arrived.
        return max(self.in_flight, self.reported_load + self.in_flight - self.in_flight_at_report)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    model: str
    total_tokens: int  # prompt tokens + max_tokens: what must fit in the worker's context


def can_serve(worker: WorkerView, model: str) -> bool:
    return worker.status is WorkerStatus.ACTIVE and worker.role in SERVING_ROLES and worker.model == model


def context_limit(workers: Sequence[WorkerView], model: str) -> int | None:
    """The longest context any worker able to serve `model` offers; None when there is none."""
    limits = [worker.max_model_len for worker in workers if can_serve(worker, model)]
    return max(limits) if limits else None


def choose_worker(workers: Sequence[WorkerView], request: RouteRequest) -> str | None:
    """The least-loaded worker that can take `request`, or None when none can.

    Load is relative to each worker's batch capacity. Ties go to the worker this router
    picked least recently (round-robin among equals), then to the smallest worker id, so
    the choice is a pure function of the views.
    """
    candidates = [worker for worker in workers
                  if can_serve(worker, request.model) and worker.max_model_len >= request.total_tokens]
    if not candidates:
        return None
    best = min(candidates, key=lambda worker: (worker.predicted_load / max(worker.max_num_seqs, 1),
                                               worker.last_routed, worker.worker_id))
    return best.worker_id
