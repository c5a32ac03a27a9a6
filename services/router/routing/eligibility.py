"""Eligibility, the first stage of routing: which workers may take a request at all.

Pure and synchronous; the same for every policy (`decide()` runs it before the policy).

- A *serving* worker takes a whole request, or its decode part: ACTIVE, of the request's
  model, in role BOTH or DECODE, with room for the prompt and `max_tokens`.
- A *prefill* worker may compute the prompt of a disaggregated request: ACTIVE, of the
  model, in role PREFILL (or BOTH too, with `RoutingConfig.prefill_from` "any": any worker
  may prefill for any other), with room for the prompt and the one token it generates.
- Admission: workers whose predicted running+waiting is past `max_num_seqs x
  max_queue_factor` take nothing new; when every serving worker is past it the answer is a
  refusal ("overloaded"), not an unbounded queue. A resumed request skips this: it was
  admitted once.
- A request naming a LoRA adapter: only workers with adapter slots, and of the admitted
  ones those that hold it, else those with a free slot, else the rest (`adapters`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.router.routing.adapters import able_to_serve, preferred
from services.router.routing.config import RoutingConfig
from services.router.routing.request import RouteRefusal, RouteRequest
from services.router.routing.view import WorkerView
from shared.schemas.membership import WorkerRole, WorkerStatus

SERVING_ROLES = frozenset({WorkerRole.BOTH, WorkerRole.DECODE})
PREFILL_ROLES = {"prefill": frozenset({WorkerRole.PREFILL}), "any": frozenset({WorkerRole.PREFILL, WorkerRole.BOTH})}


def can_serve(worker: WorkerView, model: str) -> bool:
    return worker.status is WorkerStatus.ACTIVE and worker.role in SERVING_ROLES and worker.model == model


def context_limit(workers: Sequence[WorkerView], model: str) -> int | None:
    """The longest context any worker able to serve `model` offers; None when there is none."""
    limits = [worker.max_model_len for worker in workers if can_serve(worker, model)]
    return max(limits) if limits else None


def queue_full(worker: WorkerView, routing: RoutingConfig) -> bool:
    return routing.max_queue_factor > 0 and worker.predicted_load >= worker.max_num_seqs * routing.max_queue_factor


@dataclass(slots=True, unsafe_hash=True)
class Eligible:  # read-only by convention (not frozen: built per request, and a frozen dataclass is slow to build)
    serving: list[WorkerView]  # may serve the request (or its decode part), admitted
    prefill: list[WorkerView]  # may compute its prompt as a prefill worker, admitted
    # Some prefill worker could compute the prompt, admission aside (one past its queue
    # limit counts as busy, not as missing).
    prefill_exists: bool


def eligible(workers: Sequence[WorkerView], request: RouteRequest,
             routing: RoutingConfig) -> Eligible | RouteRefusal | None:
    """The workers that may take `request`; a refusal; or None when none can (the caller waits)."""
    if request.adapter:
        workers = able_to_serve(workers, request.adapter)
    serving = [worker for worker in workers
               if can_serve(worker, request.model) and worker.max_model_len >= request.total_tokens]
    if not serving:
        return None  # a prefill worker never serves a whole request
    roles = PREFILL_ROLES[routing.prefill_from]
    prefill = [worker for worker in workers
               if worker.role in roles and worker.status is WorkerStatus.ACTIVE
               and worker.model == request.model and worker.max_model_len >= request.prompt_tokens + 1]
    prefill_exists = bool(prefill)
    if request.admit:
        serving = [worker for worker in serving if not queue_full(worker, routing)]
        if not serving:
            return RouteRefusal("overloaded")
        prefill = [worker for worker in prefill if not queue_full(worker, routing)]
    if request.adapter:
        serving, prefill = preferred(serving, request.adapter), preferred(prefill, request.adapter)
    return Eligible(serving, prefill, prefill_exists)
