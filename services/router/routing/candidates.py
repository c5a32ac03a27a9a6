"""Scoring, the second stage of routing: what each candidate flow of a request would cost.

Pure and synchronous. `decide()` builds one `Candidates` per request over the eligible
workers and hands it to the policy, which picks from it; the plan builder then reads the
chosen flow's cost and prefill plan from the same object (each worker's plan is computed
once, lazily).

- `single(worker)`: the worker serves the request alone (computes the prompt, pulling a
  cached prefix from a holder if one has more of it, and generates every token);
- `prefill_part(worker)`: the worker computes the prompt for a decode worker;
- `best_single(...)`, `best_part(...)`: the cheapest worker, after bounded affinity
  (`affine`), or, for a prompt that no worker holds half of or a prefix that leaves its
  home, the one the home rules pick (`placement.rules.HomeRules`, over the request's
  placement snapshot; the plan builder asks them whether the pick moves the prefix's home);
- `best_pair(...)`: the cheapest (prefill, decode) pair of one compatibility hash.

Ties between equal costs go to the least-loaded worker relative to batch capacity, then to
the one this router picked least recently (round-robin among equals), then to the smallest
id (`load_order`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.router.config import RoutingConfig
from services.router.routing.cost import Holders, PrefillPlan, decode_cost, plan_prefill, prefill_cost, prefix_is_hot
from services.router.routing.eligibility import Eligible
from services.router.routing.placement.rules import HomeRules
from services.router.routing.recency import victim_values
from services.router.routing.request import RouteRequest
from services.router.routing.view import WorkerView


def load_order(worker: WorkerView) -> tuple[float, int, str]:
    return worker.relative_load, worker.last_routed, worker.worker_id


@dataclass(frozen=True, slots=True)
class Single:
    worker: WorkerView
    plan: PrefillPlan
    cost: float

    @property
    def key(self) -> tuple:
        return self.cost, load_order(self.worker)


@dataclass(frozen=True, slots=True)
class Pair:
    prefill: Single  # its cost: the prefill part only
    decode: WorkerView
    cost: float

    @property
    def key(self) -> tuple:
        return self.cost, load_order(self.decode), load_order(self.prefill.worker)


class Candidates:
    """The request's candidate flows over one set of views, costed lazily and once each."""

    def __init__(self, workers: Sequence[WorkerView], request: RouteRequest, routing: RoutingConfig,
                 eligible: Eligible) -> None:
        self.request = request
        self.routing = routing
        self.eligible = eligible
        self._holders = Holders(workers, request.held_tokens if routing.prefix_pull else {})
        # a hot prefix (every holder busy) may be copied: bounded affinity lets go of it
        self.replicate = prefix_is_hot(routing, eligible.serving, request.cached_tokens, request.prompt_tokens,
                                       request.placement.share)
        self._plans: dict[str, PrefillPlan] = {}
        self._computing = [*eligible.prefill, *eligible.serving]  # may compute the prompt
        self._victim_values: dict[str, float] | None = None
        self.home_rules = HomeRules(request, routing)  # where a weakly cached prompt, or a leaving prefix, goes

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
        return Single(worker, plan, self._prefill_cost(plan, worker) + decode_cost(self.routing, worker))

    def prefill_part(self, worker: WorkerView) -> Single:
        plan = self.plan(worker)
        return Single(worker, plan, self._prefill_cost(plan, worker))

    def _prefill_cost(self, plan: PrefillPlan, worker: WorkerView) -> float:
        return prefill_cost(self.routing, plan, worker, victim_value=self._victim_value(worker))

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
        return Pair(part, decode, part.cost + decode_cost(self.routing, decode))

    def affine(self, parts: Sequence[Single]) -> Sequence[Single]:
        """Bounded-load affinity: when some of `parts` hold at least half of the prompt, only
        the holders of the longest such prefix, and workers with room to take the prompt
        without evicting anything, unless the prefix is hot (`replicate`: its holders carry
        far more than the mean load). Per request, a full non-holder may look cheaper once
        the holder's queue grows; but moving the request there recomputes (or copies) the
        prefix and evicts another, work the whole cluster pays for later: under sustained
        load that spreads every tenant over every worker and churns every cache. The bound
        on the holders' load is relative (`hot_load_factor` x the mean), so it holds as
        queues grow with the offered load."""
        if not self.routing.bounded_affinity or self.replicate or not parts:
            return parts
        longest = max(part.plan.cached_tokens for part in parts)
        if 2 * longest < self.request.prompt_tokens:
            return parts
        return [part for part in parts if part.plan.cached_tokens == longest or self._has_room(part)]

    def _has_room(self, part: Single) -> bool:
        free = part.worker.free_kv_tokens
        return free is not None and free >= part.plan.pulled_tokens + part.plan.uncached_tokens + part.plan.loaded_tokens

    def best_single(self, workers: Sequence[WorkerView]) -> Single | None:
        return self.best_part([self.single(worker) for worker in workers]) if workers else None

    def best_part(self, parts: Sequence[Single]) -> Single | None:
        """The cheapest of `parts` after bounded affinity (`affine`); for a weakly cached
        prompt, or a prefix that leaves its home, its home (the home rules,
        `placement.rules.HomeRules`: `weak`, `leaves`, `home`)."""
        leaving = self.home_rules.leaves(parts)
        if self.home_rules.weak or leaving is not None:
            if not parts:
                return None
            return self.home_rules.home(parts, leaving)
        parts = self.affine(parts)
        return min(parts, key=lambda part: part.key) if parts else None

    def best_pair(self, prefill_workers: Sequence[WorkerView], decode_workers: Sequence[WorkerView]) -> Pair | None:
        """The cheapest pair: the cost splits into a prefill part and a decode part, so per
        hash the cheapest of each side pair up (O(workers), not O(prefill x decode))."""
        by_hash: dict[str, list[Single]] = {}
        for worker in prefill_workers:
            by_hash.setdefault(worker.compat_hash, []).append(self.prefill_part(worker))
        best_prefill = {compat_hash: best for compat_hash, parts in by_hash.items()
                        if (best := self.best_part(parts)) is not None}
        best_decode: dict[str, tuple[float, WorkerView]] = {}
        for worker in decode_workers:
            cost = decode_cost(self.routing, worker)
            held_decode = best_decode.get(worker.compat_hash)
            if held_decode is None or (cost, load_order(worker)) < (held_decode[0], load_order(held_decode[1])):
                best_decode[worker.compat_hash] = (cost, worker)
        pairs = [Pair(prefill, best_decode[compat_hash][1], prefill.cost + best_decode[compat_hash][0])
                 for compat_hash, prefill in best_prefill.items() if compat_hash in best_decode]
        return min(pairs, key=lambda pair: pair.key) if pairs else None
