"""The kv-aware policy's picks among the flows the scoring stage priced (`candidates`).

Per request, over its `Candidates`:
- `single(workers)`, `part(parts)`: the cheapest worker, after bounded affinity (`affine`),
  or, for a prompt that no worker holds half of or a prefix that leaves its home, the one
  the home rules pick (`placement.rules.HomeRules`, over the request's placement snapshot);
- `pair(...)`: the cheapest (prefill, decode) pair of one compatibility hash;
- `selection(...)`: the policy's answer, saying whether its computing worker is the
  prefix's new home (a home the home rules picked as the prefix left its old one).

Ties between equal costs go to the least-loaded worker relative to batch capacity, then to
the one this router picked least recently (round-robin among equals), then to the smallest
id (`load_order`).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.router.routing.candidates import Candidates, Pair, Single
from services.router.routing.cost import handoff_cost
from services.router.routing.placement.rules import HomeRules
from services.router.routing.placement.shares import prefix_is_hot
from services.router.routing.plan import RouteReason, Selection
from services.router.routing.view import WorkerView


def load_order(worker: WorkerView) -> tuple[float, int, str]:
    return worker.relative_load, worker.last_routed, worker.worker_id


def single_order(single: Single) -> tuple:
    return single.cost, load_order(single.worker)


def pair_order(pair: Pair) -> tuple:
    return pair.cost, load_order(pair.decode), load_order(pair.prefill.worker)


class Cheapest:
    """The picks for one request (its new homes noted across them, in `home_rules`)."""

    def __init__(self, candidates: Candidates) -> None:
        self.candidates = candidates
        request, routing = candidates.request, candidates.routing
        # a hot prefix (every holder busy) may be copied: bounded affinity lets go of it
        self.replicate = prefix_is_hot(routing, candidates.eligible.serving, request.cached_tokens,
                                       request.prompt_tokens, request.placement.share)
        self.home_rules = HomeRules(request, routing)  # where a weakly cached prompt, or a leaving prefix, goes

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
        if not self.candidates.routing.bounded_affinity or self.replicate or not parts:
            return parts
        longest = max(part.plan.cached_tokens for part in parts)
        if 2 * longest < self.candidates.request.prompt_tokens:
            return parts
        return [part for part in parts if part.plan.cached_tokens == longest or _has_room(part)]

    def single(self, workers: Sequence[WorkerView]) -> Single | None:
        return self.part([self.candidates.single(worker) for worker in workers]) if workers else None

    def part(self, parts: Sequence[Single]) -> Single | None:
        """The cheapest of `parts` after bounded affinity (`affine`); for a weakly cached
        prompt, or a prefix that leaves its home, its home (the home rules,
        `placement.rules.HomeRules`: `weak`, `leaves`, `home`)."""
        leaving = self.home_rules.leaves(parts)
        if self.home_rules.weak or leaving is not None:
            if not parts:
                return None
            return self.home_rules.home(parts, leaving)
        parts = self.affine(parts)
        return min(parts, key=single_order) if parts else None

    def prefill_part(self, parts: Sequence[Single]) -> Single | None:
        """The prefill part of a pair: `part`; where any worker may prefill (`prefill_from`
        "any"), the cheapest after bounded affinity, home rules aside: the home rules place a
        prompt's KV where it stays, and a pair's KV stays where it decodes (its prefill worker
        computes it for another), so a queue-free home must not draw a prompt that would
        stall the decodes running there."""
        if self.candidates.routing.prefill_from != "any":
            return self.part(parts)
        parts = self.affine(parts)
        return min(parts, key=single_order) if parts else None

    def pair(self, prefill_workers: Sequence[WorkerView], decode_workers: Sequence[WorkerView]) -> Pair | None:
        """The cheapest pair of two workers: the cost splits into a prefill part and a decode
        part, so per hash the cheapest of each side pair up (O(workers), not O(prefill x
        decode)); where a worker may take either part, the second cheapest decode worker
        stands in for the prefill worker itself."""
        by_hash: dict[str, list[Single]] = {}
        for worker in prefill_workers:
            by_hash.setdefault(worker.compat_hash, []).append(self.candidates.prefill_part(worker))
        best_prefill = {compat_hash: best for compat_hash, parts in by_hash.items()
                        if (best := self.prefill_part(parts)) is not None}
        decodes: dict[str, list[tuple[float, tuple, WorkerView]]] = {}
        for worker in decode_workers:
            ranked = decodes.setdefault(worker.compat_hash, [])
            ranked.append((self.candidates.decode_part(worker), load_order(worker), worker))
            ranked.sort(key=lambda entry: entry[:2])
            del ranked[2:]  # the best two: one of them is not the prefill worker
        pairs = []
        handoff = handoff_cost(self.candidates.routing, self.candidates.request.prompt_tokens)  # the same for every pair
        for compat_hash, prefill in best_prefill.items():
            decode = next((entry for entry in decodes.get(compat_hash, ())
                           if entry[2].worker_id != prefill.worker.worker_id), None)
            if decode is not None:
                pairs.append(Pair(prefill, decode[2], prefill.cost + handoff + decode[0]))
        return min(pairs, key=pair_order) if pairs else None

    def selection(self, reason: RouteReason, worker: WorkerView, prefill: WorkerView | None = None) -> Selection:
        computing = prefill or worker
        return Selection(reason, worker, prefill=prefill, moves_home=self.home_rules.moves_home(computing.worker_id))


def _has_room(part: Single) -> bool:
    free = part.worker.free_kv_tokens
    return free is not None and free >= part.plan.pulled_tokens + part.plan.uncached_tokens + part.plan.loaded_tokens
