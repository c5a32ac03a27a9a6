"""Routing policy: which worker(s) serve a request. Pure and synchronous.

Fed by `WorkerPool.views()` (the adapter); no I/O, no clock. `decide()` returns a
`RouteDecision` with one of two flows:

- "single": the request goes whole to one ACTIVE worker of its model whose role is BOTH
  or DECODE (the least loaded).
- "disaggregated" (prefill-first XpYd): a PREFILL worker computes the prompt and the first
  token, and a DECODE worker pulls its KV blocks and generates the rest. Chosen whenever
  the model has an ACTIVE PREFILL worker and an ACTIVE DECODE worker with the same
  compatibility hash; the pair is the least-loaded prefill worker and the least-loaded
  decode worker of one hash. Workers with different hashes are never paired: their KV
  layouts differ, a hand-off between them would be refused. When no pair exists the
  request falls back to single-worker serving, and the decision says why, so an
  operator sees a hash mismatch instead of silently losing disaggregation.

BOTH workers only ever serve whole requests; they are never one half of a pair.

Load is *predicted*: the worker's last reported `running + waiting`, corrected by how
this router's own in-flight count on that worker changed since the report arrived. A
burst of requests landing between two load reports therefore spreads across workers
instead of piling onto the one that looked idle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from shared.schemas.membership import WorkerRole, WorkerStatus

SERVING_ROLES = frozenset({WorkerRole.BOTH, WorkerRole.DECODE})

Flow = Literal["single", "disaggregated"]
# Why a flow was chosen; metric label values, so a small closed set.
RouteReason = Literal[
    "pair",  # disaggregated: a prefill worker and a decode worker of one compatibility hash
    "no_prefill_worker",  # single: no ACTIVE prefill worker of the model can take the prompt
    "no_decode_worker",  # single: prefill workers exist, but no ACTIVE decode worker can take the request
    "compat_hash_mismatch",  # single: prefill and decode workers exist, but no two share a hash
]


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
    compat_hash: str  # equal hashes can exchange KV blocks

    @property
    def predicted_load(self) -> int:
        if self.reported_load is None:
            return self.in_flight
        # The report already counts the requests we had in flight when it arrived.
        return max(self.in_flight, self.reported_load + self.in_flight - self.in_flight_at_report)

    @property
    def relative_load(self) -> float:
        return self.predicted_load / max(self.max_num_seqs, 1)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    model: str
    prompt_tokens: int  # what a prefill worker must fit (plus the one token it generates)
    total_tokens: int  # prompt tokens + max_tokens: what must fit in a serving worker's context


@dataclass(frozen=True, slots=True)
class RouteDecision:
    flow: Flow
    reason: RouteReason
    worker_id: str  # single: serves the whole request; disaggregated: the decode worker
    prefill_worker_id: str | None = None  # disaggregated only

    def __post_init__(self) -> None:
        assert (self.flow == "disaggregated") == (self.prefill_worker_id is not None), self


def can_serve(worker: WorkerView, model: str) -> bool:
    return worker.status is WorkerStatus.ACTIVE and worker.role in SERVING_ROLES and worker.model == model


def context_limit(workers: Sequence[WorkerView], model: str) -> int | None:
    """The longest context any worker able to serve `model` offers; None when there is none."""
    limits = [worker.max_model_len for worker in workers if can_serve(worker, model)]
    return max(limits) if limits else None


def _order(worker: WorkerView) -> tuple[float, int, str]:
    """Least loaded relative to batch capacity; ties go to the worker this router picked
    least recently (round-robin among equals), then to the smallest id: a pure function."""
    return worker.relative_load, worker.last_routed, worker.worker_id


def choose_worker(workers: Sequence[WorkerView], request: RouteRequest) -> str | None:
    """The least-loaded worker that can take `request` whole, or None when none can."""
    candidates = [worker for worker in workers
                  if can_serve(worker, request.model) and worker.max_model_len >= request.total_tokens]
    if not candidates:
        return None
    return min(candidates, key=_order).worker_id


def _of_role(workers: Sequence[WorkerView], role: WorkerRole, model: str, min_context: int) -> list[WorkerView]:
    return [worker for worker in workers
            if worker.role is role and worker.status is WorkerStatus.ACTIVE and worker.model == model
            and worker.max_model_len >= min_context]


def choose_pair(workers: Sequence[WorkerView], request: RouteRequest
                ) -> tuple[WorkerView, WorkerView] | RouteReason:
    """The (prefill, decode) pair for `request`, or why there is none.

    Per compatibility hash, the least-loaded prefill and decode worker; among hashes, the
    pair with the least combined load (then the decode worker's, then the prefill's order).
    """
    prefill_workers = _of_role(workers, WorkerRole.PREFILL, request.model, request.prompt_tokens + 1)
    if not prefill_workers:
        return "no_prefill_worker"
    decode_workers = _of_role(workers, WorkerRole.DECODE, request.model, request.total_tokens)
    if not decode_workers:
        return "no_decode_worker"
    best_prefill: dict[str, WorkerView] = {}
    for worker in prefill_workers:
        held = best_prefill.get(worker.compat_hash)
        if held is None or _order(worker) < _order(held):
            best_prefill[worker.compat_hash] = worker
    pairs = []
    for compat_hash, prefill in best_prefill.items():
        decodes = [worker for worker in decode_workers if worker.compat_hash == compat_hash]
        if decodes:
            pairs.append((prefill, min(decodes, key=_order)))
    if not pairs:
        return "compat_hash_mismatch"
    return min(pairs, key=lambda pair: (pair[0].relative_load + pair[1].relative_load,
                                        _order(pair[1]), _order(pair[0])))


def decide(workers: Sequence[WorkerView], request: RouteRequest) -> RouteDecision | None:
    """How to serve `request` now, or None when no worker can (the caller waits)."""
    pair = choose_pair(workers, request)
    if not isinstance(pair, str):
        prefill, decode = pair
        return RouteDecision("disaggregated", "pair", decode.worker_id, prefill_worker_id=prefill.worker_id)
    worker_id = choose_worker(workers, request)
    if worker_id is None:
        return None
    return RouteDecision("single", pair, worker_id)
