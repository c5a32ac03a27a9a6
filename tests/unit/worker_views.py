"""Routing `WorkerView`s for the router's unit tests: an ACTIVE worker of both roles serving
model "m", idle and never routed to, unless a test says otherwise. A test file fixes its own
defaults with `functools.partial` (a call's keywords still win)."""

from __future__ import annotations

from services.router.routing import WorkerView
from shared.schemas import WorkerRole, WorkerStatus


def worker_view(worker_id: str, **fields) -> WorkerView:
    defaults = dict(model="m", role=WorkerRole.BOTH, status=WorkerStatus.ACTIVE, max_num_seqs=8, max_model_len=1024,
                    reported_load=0, in_flight=0, in_flight_at_report=0, last_routed=0, compat_hash="h")
    return WorkerView(worker_id=worker_id, **{**defaults, **fields})
