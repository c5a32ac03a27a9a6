"""The KV-aware policy (the default): the cost model of `cost`, with conditional
disaggregation and decode-first.

Choice, in order, among the eligible workers (each "cheapest" after bounded affinity and
the home rules, `cheapest`):
1. Decode-first (a request with a cache-hit threshold): the cheapest serving worker whose
   own cached share of the prompt reaches the threshold serves it alone; if none does, the
   refusal "cache_threshold" names the best-cached one.
2. Conditional disaggregation: a decode worker serves a request alone when fewer than
   `local_prefill_tokens` (its `KvAwareConfig`) of the prompt are uncached there ("small_uncached"), or when every
   prefill worker is busy ("prefill_busy"); otherwise the cheapest of the pairs (one per
   hash) and the BOTH workers wins ("pair", or "single_cheaper"; on a tie, disaggregate).
   With `prefill_from` "any", BOTH workers take either part of a pair too (never both parts):
   a fleet of all-round workers disaggregates each request only where the cost model (its
   interference terms, `cost.interference`) says a pair beats serving it whole.
   Without any pair, the cheapest serving worker does, and the reason says why there was no
   pair, so an operator sees a hash mismatch instead of silently losing disaggregation.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.router.routing.candidates import Candidates, Single
from services.router.routing.config import KvAwareConfig
from services.router.routing.plan import RouteReason, Selection
from services.router.routing.policies.cheapest import Cheapest, single_order
from services.router.routing.policy import PolicySpec
from services.router.routing.request import RouteRefusal
from services.router.routing.view import WorkerView
from shared.schemas.membership import WorkerRole


class KvAwarePolicy:
    def __init__(self, config: KvAwareConfig) -> None:
        self.config = config

    def select(self, candidates: Candidates) -> Selection | RouteRefusal:
        request, routing, eligible = candidates.request, candidates.routing, candidates.eligible
        cheapest = Cheapest(candidates)
        if request.cache_hit_threshold > 0:
            return _decode_first(cheapest)
        decode = [worker for worker in eligible.serving if worker.role is WorkerRole.DECODE]
        both = [worker for worker in eligible.serving if worker.role is WorkerRole.BOTH]
        prefill_busy = eligible.prefill_exists and all(  # all past admission: busy too
            worker.predicted_prefill_tokens >= self.config.prefill_busy_tokens for worker in eligible.prefill)
        if prefill_busy and decode:
            return _local_or_both(cheapest, "prefill_busy", decode, both)

        # with any worker allowed to prefill for another, a both worker may take a decode part too
        decode_side = decode + both if routing.prefill_from == "any" else decode
        pair = cheapest.pair(eligible.prefill, decode_side)
        if pair is None:
            single = cheapest.single(eligible.serving)
            assert single is not None
            selection = cheapest.selection(_no_pair_reason(eligible.prefill, decode_side), single.worker)
            if selection.reason == "compat_hash_mismatch":
                selection.note = no_pair_note(eligible.prefill, decode_side)
            return selection

        small = [worker for worker in decode if candidates.plan(worker).uncached_tokens < self.config.local_prefill_tokens]
        if small:
            return _local_or_both(cheapest, "small_uncached", small, both)
        best_both = cheapest.single(both)
        if best_both is not None and best_both.cost < pair.cost:  # on a tie, disaggregate
            return cheapest.selection("single_cheaper", best_both.worker)
        return cheapest.selection("pair", pair.decode, prefill=pair.prefill.worker)


def _local_or_both(cheapest: Cheapest, reason: RouteReason, local: Sequence[WorkerView],
                   both: Sequence[WorkerView]) -> Selection:
    """The cheapest of the `local` decode workers, unless a BOTH worker is cheaper still."""
    best_local = cheapest.single(local)
    assert best_local is not None
    best: Single = min((best_local, *map(cheapest.candidates.single, both)), key=single_order)
    return cheapest.selection(reason if best is best_local else "single_cheaper", best.worker)


def _no_pair_reason(prefill: Sequence[WorkerView], decode: Sequence[WorkerView]) -> RouteReason:
    if not prefill:
        return "no_prefill_worker"
    if not decode:
        return "no_decode_worker"
    if len({worker.worker_id for worker in (*prefill, *decode)}) == 1:
        return "one_worker"
    return "compat_hash_mismatch"


def no_pair_note(prefill: Sequence[WorkerView], decode: Sequence[WorkerView]) -> str:
    """Why no prefill worker's KV maps to a decode worker's: the fields that differ between
    the first two whose layouts are known (`shared.compat.KvLayout.refusal`)."""
    for first in prefill:
        for second in decode:
            if first.kv_layout is not None and second.kv_layout is not None:
                refusal = first.kv_layout.refusal(second.kv_layout)
                if refusal:
                    return f"{first.worker_id} -> {second.worker_id}: {refusal}"
    return "the prefill and decode workers' compatibility hashes differ"


def _decode_first(cheapest: Cheapest) -> Selection | RouteRefusal:
    """Only a worker already holding enough of the prompt serves it, alone."""
    candidates = cheapest.candidates
    request = candidates.request
    hits = [(worker, candidates.plan(worker).cached_tokens) for worker in candidates.eligible.serving]
    warm = [worker for worker, cached in hits if cached >= request.cache_hit_threshold * request.prompt_tokens]
    if warm:
        single = cheapest.single(warm)
        assert single is not None
        return cheapest.selection("decode_first", single.worker)
    worker, cached = max(hits, key=lambda hit: (hit[1], -hit[0].relative_load, hit[0].worker_id))
    return RouteRefusal("cache_threshold", worker.worker_id, cached)


KV_AWARE = PolicySpec("kv-aware", "the cost model: prefix affinity, load, conditional disaggregation",
                      lambda routing: KvAwarePolicy(routing.kv_aware))
