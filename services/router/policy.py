"""Routing policy: which worker(s) serve a request, or why none does now. Pure and synchronous.

Fed by the dispatcher with `WorkerPool.views()` and, per worker, how much of the prompt
the KV index says it holds; no I/O, no clock. `decide()` returns a `RouteDecision`, a
`RouteRefusal`, or None (no worker can take the request: the caller waits).

Flows:
- "single": the request goes whole to one ACTIVE worker of its model whose role is BOTH
  or DECODE; it computes the prompt (pulling a cached prefix from a holder, if one has
  more of it) and generates every token.
- "disaggregated" (prefill-first XpYd): a PREFILL worker computes the prompt and the first
  token, and a DECODE worker with the *same compatibility hash* pulls its KV blocks and
  generates the rest. Workers with different hashes are never paired: their KV layouts
  (or model versions) differ, a hand-off between them would be refused.

Choice, in order:
1. Admission: workers whose predicted running+waiting is past `max_num_seqs x
   max_queue_factor` take nothing new; when every candidate is past it the answer is a
   refusal ("overloaded"), not an unbounded queue. A resumed request skips this: it was
   admitted once.
2. Decode-first (a request with a cache-hit threshold): the cheapest serving worker whose
   own cached share of the prompt reaches the threshold serves it alone; if none does,
   the refusal "cache_threshold" names the best-cached one.
3. Conditional disaggregation: a decode worker serves a request alone when fewer than
   `local_prefill_tokens` of the prompt are uncached there ("small_uncached"), or when
   every prefill worker is busy ("prefill_busy"); otherwise the cheapest of the pairs
   (one per hash) and the BOTH workers wins (`cost`). Without any pair, the cheapest
   serving worker does, and the reason says why there was no pair, so an operator sees a
   hash mismatch instead of silently losing disaggregation.
How a disaggregated pair hands the prompt's KV over (`kv_transfer_mode`): "pull" always
works; "push" (`RoutingConfig.pd_transfer`) only where both engines' data planes
implement it and no cached prefix is to be pulled onto the prefill worker first.
Ties go to the least-loaded worker relative to batch capacity, then to the one this
router picked least recently (round-robin among equals), then to the smallest id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from services.router.cost import Holders, PrefillPlan, decode_cost, plan_prefill, prefill_cost
from services.router.worker_view import WorkerView
from shared.config import RoutingConfig
from shared.schemas.membership import WorkerRole, WorkerStatus

__all__ = ["Flow", "KvTransferMode", "RouteDecision", "RouteReason", "RouteRefusal", "RouteRequest", "WorkerView", "can_serve",
           "context_limit", "decide", "kv_transfer_mode"]

SERVING_ROLES = frozenset({WorkerRole.BOTH, WorkerRole.DECODE})
DEFAULT_ROUTING = RoutingConfig()

Flow = Literal["single", "disaggregated"]
KvTransferMode = Literal["pull", "push"]
# Why a flow was chosen; metric label values, so a small closed set.
RouteReason = Literal[
    "pair",  # disaggregated: the cheapest flow is a prefill and a decode worker of one compatibility hash
    "small_uncached",  # single on a decode worker: less than `local_prefill_tokens` uncached there
    "prefill_busy",  # single on a decode worker: every prefill worker is busy
    "single_cheaper",  # single on a BOTH worker: cheaper than every pair
    "decode_first",  # single: the request's cache-hit threshold chose the worker
    "baseline",  # single: a benchmark baseline policy (round-robin or random) chose the worker
    "no_prefill_worker",  # single: no ACTIVE prefill worker of the model can take the prompt
    "no_decode_worker",  # single: prefill workers exist, but no ACTIVE decode worker can take the request
    "compat_hash_mismatch",  # single: prefill and decode workers exist, but no two share a hash
]
RefusalReason = Literal[
    "overloaded",  # every candidate worker is past its queue limit: try again later (429)
    "cache_threshold",  # no worker holds enough of the prompt for the request's cache-hit threshold
]


@dataclass(frozen=True, slots=True)
class RouteRequest:
    model: str
    prompt_tokens: int  # what a prefill worker must fit (plus the one token it generates)
    total_tokens: int  # prompt tokens + max_tokens: what must fit in a serving worker's context
    # Per worker, the leading prompt tokens it holds per the KV index: `cached_tokens` counts
    # blocks predicted for requests just routed there, `held_tokens` only reported ones.
    cached_tokens: Mapping[str, int] = field(default_factory=dict)
    held_tokens: Mapping[str, int] = field(default_factory=dict)
    cache_hit_threshold: float = 0.0  # decode-first when > 0
    admit: bool = True  # False: already admitted once (a request resumed elsewhere)
    draw: float = 0.0  # a uniform draw in [0, 1) from the caller's seeded generator (random policy)


@dataclass(frozen=True, slots=True)
class RouteDecision:
    flow: Flow
    reason: RouteReason
    worker_id: str  # single: serves the whole request; disaggregated: the decode worker
    prefill_worker_id: str | None = None  # disaggregated only
    # How the computing worker gets the prompt's KV, and what the flow was estimated to cost:
    # for the span and the predictions, not part of the decision's identity.
    plan: PrefillPlan | None = field(default=None, compare=False)
    cost: float = field(default=0.0, compare=False)

    def __post_init__(self) -> None:
        assert (self.flow == "disaggregated") == (self.prefill_worker_id is not None), self

    @property
    def computing_worker_id(self) -> str:
        """The worker that computes the prompt."""
        return self.prefill_worker_id or self.worker_id


@dataclass(frozen=True, slots=True)
class RouteRefusal:
    reason: RefusalReason
    worker_id: str | None = None  # cache_threshold: the best-cached worker
    cached_tokens: int = 0  # ... and how much of the prompt it holds


def can_serve(worker: WorkerView, model: str) -> bool:
    return worker.status is WorkerStatus.ACTIVE and worker.role in SERVING_ROLES and worker.model == model


def context_limit(workers: Sequence[WorkerView], model: str) -> int | None:
    """The longest context any worker able to serve `model` offers; None when there is none."""
    limits = [worker.max_model_len for worker in workers if can_serve(worker, model)]
    return max(limits) if limits else None


def _order(worker: WorkerView) -> tuple[float, int, str]:
    return worker.relative_load, worker.last_routed, worker.worker_id


def _queue_full(worker: WorkerView, routing: RoutingConfig) -> bool:
    return routing.max_queue_factor > 0 and worker.predicted_load >= worker.max_num_seqs * routing.max_queue_factor


@dataclass(frozen=True, slots=True)
class _Single:
    worker: WorkerView
    plan: PrefillPlan
    cost: float

    @property
    def key(self) -> tuple:
        return self.cost, _order(self.worker)


@dataclass(frozen=True, slots=True)
class _Pair:
    prefill: _Single  # its cost: the prefill part only
    decode: WorkerView
    cost: float

    @property
    def key(self) -> tuple:
        return self.cost, _order(self.decode), _order(self.prefill.worker)


class _Candidates:
    """The request's candidate flows over one set of views, costed lazily and once each."""

    def __init__(self, workers: Sequence[WorkerView], request: RouteRequest, routing: RoutingConfig) -> None:
        self.request = request
        self.routing = routing
        self._holders = Holders(workers, request.held_tokens)
        self._plans: dict[str, PrefillPlan] = {}

    def plan(self, worker: WorkerView) -> PrefillPlan:
        plan = self._plans.get(worker.worker_id)
        if plan is None:
            plan = plan_prefill(worker, self.request.prompt_tokens, self.request.cached_tokens, self._holders)
            self._plans[worker.worker_id] = plan
        return plan

    def single(self, worker: WorkerView) -> _Single:
        plan = self.plan(worker)
        return _Single(worker, plan, prefill_cost(self.routing, plan, worker) + decode_cost(self.routing, worker))

    def prefill_part(self, worker: WorkerView) -> _Single:
        plan = self.plan(worker)
        return _Single(worker, plan, prefill_cost(self.routing, plan, worker))

    def best_single(self, workers: Sequence[WorkerView]) -> _Single | None:
        singles = [self.single(worker) for worker in workers]
        return min(singles, key=lambda single: single.key) if singles else None

    def best_pair(self, prefill_workers: Sequence[WorkerView], decode_workers: Sequence[WorkerView]) -> _Pair | None:
        """The cheapest pair: the cost splits into a prefill part and a decode part, so per
        hash the cheapest of each side pair up (O(workers), not O(prefill x decode))."""
        best_prefill: dict[str, _Single] = {}
        for worker in prefill_workers:
            part = self.prefill_part(worker)
            held = best_prefill.get(worker.compat_hash)
            if held is None or part.key < held.key:
                best_prefill[worker.compat_hash] = part
        best_decode: dict[str, tuple[float, WorkerView]] = {}
        for worker in decode_workers:
            cost = decode_cost(self.routing, worker)
            held_decode = best_decode.get(worker.compat_hash)
            if held_decode is None or (cost, _order(worker)) < (held_decode[0], _order(held_decode[1])):
                best_decode[worker.compat_hash] = (cost, worker)
        pairs = [_Pair(prefill, best_decode[compat_hash][1], prefill.cost + best_decode[compat_hash][0])
                 for compat_hash, prefill in best_prefill.items() if compat_hash in best_decode]
        return min(pairs, key=lambda pair: pair.key) if pairs else None


def _single(reason: RouteReason, single: _Single) -> RouteDecision:
    return RouteDecision("single", reason, single.worker.worker_id, plan=single.plan, cost=single.cost)


def decide(workers: Sequence[WorkerView], request: RouteRequest,
           routing: RoutingConfig = DEFAULT_ROUTING) -> RouteDecision | RouteRefusal | None:
    """How to serve `request` now; a refusal; or None when no worker can (the caller waits)."""
    serving = [worker for worker in workers
               if can_serve(worker, request.model) and worker.max_model_len >= request.total_tokens]
    if not serving:
        return None  # a prefill worker never serves a whole request
    prefill = [worker for worker in workers
               if worker.role is WorkerRole.PREFILL and worker.status is WorkerStatus.ACTIVE
               and worker.model == request.model and worker.max_model_len >= request.prompt_tokens + 1]
    eligible_prefill = bool(prefill)
    if request.admit:
        serving = [worker for worker in serving if not _queue_full(worker, routing)]
        if not serving:
            return RouteRefusal("overloaded")
        prefill = [worker for worker in prefill if not _queue_full(worker, routing)]
    candidates = _Candidates(workers, request, routing)
    if routing.policy != "kv-aware":
        return _single("baseline", candidates.single(_baseline_choice(serving, request, routing)))

    if request.cache_hit_threshold > 0:
        return _decode_first(serving, candidates)

    decode = [worker for worker in serving if worker.role is WorkerRole.DECODE]
    both = [worker for worker in serving if worker.role is WorkerRole.BOTH]
    prefill_busy = eligible_prefill and all(worker.predicted_prefill_tokens >= routing.prefill_busy_tokens
                                            for worker in prefill)  # all past admission: busy too
    if prefill_busy and decode:
        local = candidates.best_single(decode)
        assert local is not None
        cheapest = min((local, *map(candidates.single, both)), key=lambda single: single.key)
        return _single("prefill_busy" if cheapest is local else "single_cheaper", cheapest)

    pair = candidates.best_pair(prefill, decode)
    if pair is None:
        single = candidates.best_single(serving)
        assert single is not None
        return _single(_no_pair_reason(prefill, decode), single)

    small = [worker for worker in decode if candidates.plan(worker).uncached_tokens < routing.local_prefill_tokens]
    if small:
        local = candidates.best_single(small)
        assert local is not None
        cheapest = min((local, *map(candidates.single, both)), key=lambda single: single.key)
        return _single("small_uncached" if cheapest is local else "single_cheaper", cheapest)
    best_both = candidates.best_single(both)
    if best_both is not None and best_both.cost < pair.cost:  # on a tie, disaggregate
        return _single("single_cheaper", best_both)
    return RouteDecision("disaggregated", "pair", pair.decode.worker_id,
                         prefill_worker_id=pair.prefill.worker.worker_id, plan=pair.prefill.plan, cost=pair.cost)


def _baseline_choice(serving: Sequence[WorkerView], request: RouteRequest, routing: RoutingConfig) -> WorkerView:
    """Round-robin: the worker picked longest ago. Random: the request's draw picks one."""
    ordered = sorted(serving, key=lambda worker: worker.worker_id)
    if routing.policy == "round-robin":
        return min(ordered, key=lambda worker: worker.last_routed)
    return ordered[min(int(request.draw * len(ordered)), len(ordered) - 1)]


def _no_pair_reason(prefill: Sequence[WorkerView], decode: Sequence[WorkerView]) -> RouteReason:
    if not prefill:
        return "no_prefill_worker"
    if not decode:
        return "no_decode_worker"
    return "compat_hash_mismatch"


def _decode_first(serving: Sequence[WorkerView], candidates: _Candidates) -> RouteDecision | RouteRefusal:
    """Only a worker already holding enough of the prompt serves it, alone."""
    request = candidates.request
    hits = [(worker, candidates.plan(worker).cached_tokens) for worker in serving]
    warm = [worker for worker, cached in hits if cached >= request.cache_hit_threshold * request.prompt_tokens]
    if warm:
        single = candidates.best_single(warm)
        assert single is not None
        return _single("decode_first", single)
    worker, cached = max(hits, key=lambda hit: (hit[1], -hit[0].relative_load, hit[0].worker_id))
    return RouteRefusal("cache_threshold", worker.worker_id, cached)


def kv_transfer_mode(routing: RoutingConfig, prefill: WorkerView, decode: WorkerView, *,
                     prefix_pull: bool) -> KvTransferMode:
    """How a disaggregated pair hands the prompt's KV over. Push needs both engines to
    implement it (their advertised capabilities); and a pushing prefill worker pulls no cached prefix, so a planned prefix
    pull keeps the pull flow (its cost assumed that pull)."""
    if routing.pd_transfer == "push" and not prefix_pull and prefill.kv_push and decode.kv_push:
        return "push"
    return "pull"
