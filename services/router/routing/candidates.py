"""Scoring, the second stage of routing: what each candidate flow of a request would cost.

Pure and synchronous. `decide()` builds one `Candidates` per request over the eligible
workers and hands it to the policy, which picks from it (the kv-aware policy through
`policies.cheapest`); the plan builder then reads the chosen flow's cost and prefill plan
from the same object (each worker's plan is computed once, lazily). It prices; it does
not choose.

- `single(worker)`: the worker serves the request alone (computes the prompt, pulling a
  cached prefix from a holder if one has more of it, and generates every token);
- `prefill_part(worker)`: the worker computes the prompt for a decode worker;
- `pair(prefill, decode)`: the prefill part on one worker, the decode part on the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.router.routing.config import RoutingConfig
from services.router.routing.cost import (
    Holders,
    PrefillPlan,
    decode_cost,
    decode_exposure,
    handoff_cost,
    plan_prefill,
    prefill_cost,
)
from services.router.routing.eligibility import Eligible
from services.router.routing.recency import victim_values
from services.router.routing.request import RouteRequest
from services.router.routing.view import WorkerView


@dataclass(slots=True, unsafe_hash=True)
class Single:  # read-only by convention (not frozen: built per request, and a frozen dataclass is slow to build)
    worker: WorkerView
    plan: PrefillPlan
    cost: float


@dataclass(slots=True, unsafe_hash=True)
class Pair:  # read-only by convention (not frozen: built per request, and a frozen dataclass is slow to build)
    prefill: Single  # its cost: the prefill part only
    decode: WorkerView
    cost: float


class Candidates:
    """The request's candidate flows over one set of views, costed lazily and once each (a
    worker's prefill part and decode part each computed once, whichever flows read them)."""

    def __init__(self, workers: Sequence[WorkerView], request: RouteRequest, routing: RoutingConfig,
                 eligible: Eligible) -> None:
        self.request = request
        self.routing = routing
        self.eligible = eligible
        self._holders = Holders(workers, request.held_tokens if routing.prefix_pull else {})
        self._plans: dict[str, PrefillPlan] = {}
        self._prefill_costs: dict[str, float] = {}  # per worker: its part as the computing worker
        self._decode_parts: dict[str, float] = {}  # per worker: its part as the decode worker
        self._computing = [*eligible.prefill, *eligible.serving]  # may compute the prompt
        self._victim_values: dict[str, float] | None = None
        self._exposed, self._exposure = self._prompt_target(eligible.serving)

    def _prompt_target(self, serving: Sequence[WorkerView]) -> tuple[str | None, float]:
        """Where any worker may prefill for any other: the serving worker with strictly the
        fewest requests decoding (where the interference term sends the next prompts) and
        what a decode placed there costs (`cost.decode_exposure`, a request in flight counted
        once: where it decodes); (None, 0) otherwise."""
        routing = self.routing
        if routing.prefill_from != "any" or not routing.itl_weight or len(serving) < 2:
            return None, 0.0
        ranked = sorted(serving, key=lambda worker: worker.decoding_load)
        if ranked[0].decoding_load == ranked[1].decoding_load:
            return None, 0.0
        in_flight = sum(worker.decoding_load for worker in serving)
        return ranked[0].worker_id, decode_exposure(routing, self.request.prompt_tokens, in_flight)

    def decode_part(self, worker: WorkerView) -> float:
        """A pair's decode worker's part of its cost (`cost.decode_cost`, and the exposure of
        the worker the next prompts go to)."""
        part = self._decode_parts.get(worker.worker_id)
        if part is None:
            part = self._decode_parts[worker.worker_id] = decode_cost(self.routing, worker) + self._exposure_of(worker)
        return part

    def _exposure_of(self, worker: WorkerView) -> float:
        return self._exposure if worker.worker_id == self._exposed else 0.0

    def plan(self, worker: WorkerView) -> PrefillPlan:
        plan = self._plans.get(worker.worker_id)
        if plan is None:
            request = self.request
            plan = plan_prefill(worker, request.prompt_tokens, request.cached_tokens, self._holders,
                                request.tier_tokens.get(worker.worker_id), self.routing)
            self._plans[worker.worker_id] = plan
        return plan

    def single(self, worker: WorkerView) -> Single:
        plan = self.plan(worker)
        decode = decode_cost(self.routing, worker, whole=True) + self._exposure_of(worker)
        return Single(worker, plan, self._prefill_cost(plan, worker) + decode)

    def prefill_part(self, worker: WorkerView) -> Single:
        plan = self.plan(worker)
        return Single(worker, plan, self._prefill_cost(plan, worker))

    def _prefill_cost(self, plan: PrefillPlan, worker: WorkerView) -> float:
        cost = self._prefill_costs.get(worker.worker_id)
        if cost is None:
            cost = self._prefill_costs[worker.worker_id] = prefill_cost(self.routing, plan, worker,
                                                                        victim_value=self._victim_value(worker))
        return cost

    def _victim_value(self, worker: WorkerView) -> float:
        """The weight of what `worker`'s cache would evict, relative to the other workers whose
        cache this prompt would overflow (ages looked up once, for those only)."""
        if not self.routing.cold_victims:
            return 1.0
        free = worker.free_kv_tokens
        if free is None or free >= self.request.prompt_tokens:
            return 1.0  # room to spare: no eviction to weigh
        if self._victim_values is None:
            full = [view.worker_id for view in self._computing
                    if view.free_kv_tokens is not None and view.free_kv_tokens < self.request.prompt_tokens]
            self._victim_values = victim_values({worker_id: self.request.victim_age_s.get(worker_id)
                                                 for worker_id in full})
        return self._victim_values.get(worker.worker_id, 1.0)

    def pair(self, prefill: WorkerView, decode: WorkerView) -> Pair:
        part = self.prefill_part(prefill)
        return Pair(part, decode, part.cost + handoff_cost(self.routing, self.request.prompt_tokens)
                    + self.decode_part(decode))
