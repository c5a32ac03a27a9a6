"""Scoring, the second stage of routing: what each candidate flow of a request would cost.

Pure and synchronous. `decide()` builds one `Candidates` per request over the eligible
workers and hands it to the policy, which picks from it; the plan builder then reads the
chosen flow's cost and prefill plan from the same object (each worker's plan is computed
once, lazily).

- `single(worker)`: the worker serves the request alone (computes the prompt, pulling a
  cached prefix from a holder if one has more of it, and generates every token);
- `prefill_part(worker)`: the worker computes the prompt for a decode worker;
- `best_pair(...)`: the cheapest (prefill, decode) pair of one compatibility hash.

Ties between equal costs go to the least-loaded worker relative to batch capacity, then to
the one this router picked least recently (round-robin among equals), then to the smallest
id (`load_order`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.router.config import RoutingConfig
from services.router.routing.cost import (
    Holders,
    PrefillPlan,
    copies_needed,
    decode_cost,
    homes_overflow,
    minor_tenant,
    plan_prefill,
    prefill_cost,
    prefix_is_hot,
    share_cap,
)
from services.router.routing.eligibility import Eligible
from services.router.routing.placement.home import IF_BUSY, LEAVE, STAY, HomeHints, prefer_home
from services.router.routing.recency import victim_values
from services.router.routing.request import RouteRequest
from services.router.routing.view import WorkerView

# why a prefix leaves its home (`Candidates.leaves`)
OVERFLOW = "overflow"  # its home's prompts overflow its KV
TRAFFIC = "traffic"  # a minor tenant of a home that carries more than one worker's part of the traffic
TRANSIENTS = "transients"  # a transient prefix, its home's transients bring far more work than another's
CROWDED = "crowded"  # a weakly cached prefix, its home's prompts leave no room for another, another's do


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
        self.new_homes: set[str] = set()  # picked as the prefix's new home as it leaves its home (`leaves`)

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

    @property
    def weak(self) -> bool:
        """No worker holds (or is predicted to hold) half of the prompt: it goes to its
        prefix's home (`placement.home`), when the prompt is at least a block long and homes are on."""
        return (self.request.prefix_key is not None and self.routing.home_slack_tokens > 0
                and 2 * max(self.request.cached_tokens.values(), default=0) < self.request.prompt_tokens)

    def _home(self, parts: Sequence[Single], leaving: str | None) -> Single:
        """`leaving`: why the prefix leaves its learned home (`leaves`), None where it does not."""
        request, routing = self.request, self.routing
        assert request.prefix_key is not None
        if not routing.sticky_homes:
            hints = HomeHints(request.prefix_key)
        elif self._transient:  # its home computes its misses: balanced by the work homed on each
            hints = HomeHints(request.prefix_key, request.placement.home, request.placement.homed_work,
                              leave=self._leave(leaving, parts), prefix_share=request.placement.share)
        elif leaving == CROWDED:
            hints = HomeHints(request.prefix_key, request.placement.home, request.placement.homed_share,
                              leave=LEAVE, prefix_share=request.placement.share, share_cap=self._share_cap(len(parts)),
                              fits=self._roomier(parts), fit_first=True)
        else:
            must_fit = leaving == TRAFFIC and not self.weak
            hints = HomeHints(request.prefix_key, request.placement.home, request.placement.homed_share,
                              leave=self._leave(leaving, parts), prefix_share=request.placement.share,
                              share_cap=self._share_cap(len(parts)), fits=self._fits(parts, must_fit),
                              fit_first=must_fit)
        return prefer_home(parts, lambda part: part.cost, lambda part: part.worker.worker_id,
                           lambda part: part.worker.predicted_prefill_tokens, hints, routing.home_slack_tokens,
                           routing.hot_load_factor, request.prompt_tokens)

    def _leave(self, leaving: str | None, parts: Sequence[Single]) -> str:
        return LEAVE if leaving is not None else self._leave_home(len(parts))

    @property
    def _past_kv(self) -> bool:
        """`resident_homes` applies: the live prefixes need more KV than the cluster holds."""
        return self.routing.resident_homes and self.request.placement.limited

    @property
    def _transient(self) -> bool:
        """Past the cluster's KV (`_past_kv`), the prefix recurs but is not resident
        (`PrefixPlacement.transient`): it misses wherever it goes, and its home is where that
        load falls."""
        return self._past_kv and self.request.placement.transient

    def _transients_unbalanced(self, parts: Sequence[Single]) -> bool:
        """For a `_transient` prefix: the prefixes homed on its home bring more than twice its
        share of the recent work more than another of `parts`' do (`PrefixPlacement.homed_work`:
        a miss weighs several hits). Moving it there then leaves its home at least as loaded as
        the new one, so no transient moves straight back."""
        request = self.request
        home = request.placement.home
        own = request.placement.prefix_work if self._transient else None
        if home is None or own is None:
            return False
        work = request.placement.homed_work
        lightest = min((work.get(part.worker.worker_id, 0.0) for part in parts if part.worker.worker_id != home),
                       default=None)
        return lightest is not None and work.get(home, 0.0) - lightest > 2 * own

    def _fits(self, parts: Sequence[Single], must_fit: bool = False) -> frozenset[str] | None:
        """Where the prefix must fit (`must_fit`: a cached prefix leaves a home that holds it,
        and must not evict elsewhere what it spares there), or past the cluster's KV
        (`_past_kv`) for a resident prefix, the workers of `parts` whose KV holds its prompt
        beside their (resident) homed prefixes' (its home: beside the others'); None otherwise
        (a transient prefix misses wherever it goes)."""
        if not must_fit and (not self._past_kv or not self.request.placement.resident):
            return None
        return frozenset(part.worker.worker_id for part in parts if self._fits_on(part.worker))

    def _fits_on(self, worker: WorkerView, adds: int | None = None) -> bool:
        """Whether `worker`'s KV holds its homed prompts and `adds` more tokens (by default the
        prefix's prompt, none on its home, where it is counted already)."""
        request = self.request
        if adds is None:
            adds = 0 if worker.worker_id == request.placement.home else request.prompt_tokens
        return (worker.kv_capacity_tokens <= 0
                or request.placement.homed_tokens.get(worker.worker_id, 0) + adds <= worker.kv_capacity_tokens)

    def _crowded(self, parts: Sequence[Single]) -> bool:
        """For a weakly cached prefix (`weak`: its home no longer holds it, so its prompt is
        computed wherever it goes) within the cluster's KV: its home's homed prompts (`_fits_on`)
        leave no room there for one more, and another of `parts` with room for its share would
        hold fewer prompt tokens with it than the home holds now (`_roomier`)."""
        request = self.request
        home = next((part.worker for part in parts if part.worker.worker_id == request.placement.home), None)
        if home is None or not self.weak or request.placement.limited:
            return False
        return not self._fits_on(home, request.prompt_tokens) and bool(self._roomier(parts))

    def _roomier(self, parts: Sequence[Single]) -> frozenset[str]:
        """The workers of `parts` other than the prefix's home with room for its share that
        would hold fewer homed prompt tokens with its prompt than its home holds now: moving
        it there lowers the fuller of the two, so it never moves straight back."""
        request = self.request
        placement = request.placement
        crowd = placement.homed_tokens.get(placement.home, 0) if placement.home is not None else 0
        cap = self._share_cap(len(parts))
        share = placement.share or 0.0
        return frozenset(part.worker.worker_id for part in parts
                         if part.worker.worker_id != placement.home
                         and placement.homed_tokens.get(part.worker.worker_id, 0) + request.prompt_tokens < crowd
                         and (cap is None or placement.homed_share.get(part.worker.worker_id, 0.0) + share <= cap))

    def _share_cap(self, workers: int) -> float | None:
        slack = self.routing.replica_share_slack
        return None if slack is None or workers < 2 else share_cap(workers, slack)

    def _leave_home(self, workers: int) -> str:
        """When the prefix's learned home is given up (`placement.home.HomeHints.leave`): LEAVE where it
        is a minor tenant of an overcommitted home; IF_BUSY where the shares are unknown, the
        prefix draws more than one worker carries, or at most half of its home's traffic (the
        home exists for its other tenants); STAY otherwise."""
        request, slack = self.request, self.routing.replica_share_slack
        if request.placement.home is None or request.placement.share is None or slack is None or workers < 2:
            return IF_BUSY
        homed = request.placement.homed_share.get(request.placement.home, 0.0)
        if minor_tenant(request.placement.share, homed, workers, slack):
            return LEAVE
        if copies_needed(request.placement.share, workers, slack) > 1 or 2 * request.placement.share <= homed:
            return IF_BUSY
        return STAY

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

    def leaves(self, parts: Sequence[Single]) -> str | None:
        """Why the prefix, cached or not, leaves its learned home now (OVERFLOW, TRAFFIC,
        TRANSIENTS or CROWDED; None: it stays): it is a minor tenant there (`cost.minor_tenant`: its home
        carries more than one worker's part of the traffic), another of `parts` has room for its
        share and its prompt (`_fits_on`), and the live prefixes fit in the cluster's KV
        (`PrefixPlacement.limited`: past it, a move costs a miss, and the overflow rules below
        apply; with this rule there too, and copies counted where served, the sim sweep's
        overfull point cached 0.70 to 0.71 of the prompt tokens against 0.73 to 0.76); or the
        prompts homed there need more KV than the home holds (`cost.homes_overflow`; past the
        cluster's KV, the resident ones), it is a minor tenant or (past the cluster's KV,
        `_past_kv`) a resident prefix drawing at most half of its home's traffic, and another of
        `parts` has room for its share (and, for the latter, its prompt). Moving it costs one
        computed prompt; leaving it queues the home's requests behind one another (and lets its
        tenants evict one another) for as long as the traffic lasts, since bounded affinity
        keeps a cached prefix's requests on its holder while the prefix draws no more than one
        worker carries. Cold starts place tenants before their shares are known, so this is how
        the partition rebalances once they are. A transient prefix (`_transient`) also leaves a
        home whose prefixes bring far more work than another's (`_transients_unbalanced`): it
        misses wherever it goes, so moving it costs little, and a worker that computes several
        transients' prompts at once evicts its own residents. A weakly cached prefix within the
        cluster's KV leaves a home too full to hold it (`_crowded`): the home evicted it for
        want of room, and taking it back would evict the next of its tenants."""
        request, slack = self.request, self.routing.replica_share_slack
        home = request.placement.home
        if (not self.routing.sticky_homes or request.prefix_key is None or home is None
                or request.placement.share is None or slack is None or len(parts) < 2):
            return None
        if self._transients_unbalanced(parts):
            return TRANSIENTS
        return self._overcommitted(parts) or (CROWDED if self._crowded(parts) else None)

    def _overcommitted(self, parts: Sequence[Single]) -> str | None:
        """OVERFLOW or TRAFFIC where `leaves` says so (None otherwise)."""
        request, slack = self.request, self.routing.replica_share_slack
        home = request.placement.home
        assert request.placement.share is not None and slack is not None
        homed = request.placement.homed_share.get(home, 0.0)
        minor = minor_tenant(request.placement.share, homed, len(parts), slack)
        shed = 2 * request.placement.share <= homed and self._past_kv and request.placement.resident
        if not (minor or shed):
            return None
        overflow = any(part.worker.worker_id == home
                       and homes_overflow(part.worker, request.placement.homed_tokens.get(home)) for part in parts)
        if not (overflow or (minor and not request.placement.limited)):
            return None
        cap = share_cap(len(parts), slack)
        room = any(part.worker.worker_id != home
                   and request.placement.homed_share.get(part.worker.worker_id, 0.0) + request.placement.share <= cap
                   and ((minor and overflow) or self._fits_on(part.worker))
                   for part in parts)
        return (OVERFLOW if overflow else TRAFFIC) if room else None

    def best_single(self, workers: Sequence[WorkerView]) -> Single | None:
        return self.best_part([self.single(worker) for worker in workers]) if workers else None

    def best_part(self, parts: Sequence[Single]) -> Single | None:
        """The cheapest of `parts` after bounded affinity (`affine`); for a weakly cached
        prompt, or a prefix that leaves its home (`leaves`), its home (`_home`): a new one
        for a leaving prefix, noted in `new_homes` (its old home may still hold the prompt,
        and the move must not be taken for a copy)."""
        leaving = self.leaves(parts)
        if self.weak or leaving is not None:
            if not parts:
                return None
            chosen = self._home(parts, leaving)
            if leaving is not None and chosen.worker.worker_id != self.request.placement.home:
                self.new_homes.add(chosen.worker.worker_id)
            return chosen
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
