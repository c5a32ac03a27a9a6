"""Adapter-aware routing: which workers a request naming a LoRA adapter goes to. Pure.

Called by eligibility (`eligibility.eligible`), for the serving and the prefill workers
apart, once admission has dropped the full ones. A worker with no adapter slot cannot serve
an adapter at all. Among the others, those holding the adapter come first, then those with a
free slot (loading it evicts nothing), then those that must evict one to load it: only the
best group present is kept, so an adapter's requests stay on its holders while one is
admitted, and spread to other workers only when none is.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

from services.router.routing.view import WorkerView


class Residency(IntEnum):
    """How a worker stands to an adapter; lower is preferred."""

    HELD = 0
    FREE_SLOT = 1
    EVICTS = 2


def residency(worker: WorkerView, adapter: str) -> Residency | None:
    """None: the worker has no adapter slot."""
    if adapter in worker.adapters:
        return Residency.HELD
    if not worker.adapter_slots:
        return None
    return Residency.FREE_SLOT if len(worker.adapters) < worker.adapter_slots else Residency.EVICTS


def able_to_serve(workers: Sequence[WorkerView], adapter: str) -> list[WorkerView]:
    """The workers that can serve `adapter` at all (every worker for the base model)."""
    if not adapter:
        return list(workers)
    return [worker for worker in workers if residency(worker, adapter) is not None]


def preferred(workers: Sequence[WorkerView], adapter: str) -> list[WorkerView]:
    """The workers of the best residency present for `adapter` (every worker for the base model)."""
    if not adapter:
        return list(workers)
    ranked = [(residency(worker, adapter), worker) for worker in workers]
    best = min((rank for rank, _ in ranked if rank is not None), default=None)
    return [worker for rank, worker in ranked if rank is not None and rank == best]
