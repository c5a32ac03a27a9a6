"""Pinned, for benchmarks and tests: the request names the worker that serves it (its route
hint), and that worker serves it alone; a hint "p>d" names a pair: p computes the prompt
and d decodes (p a worker that may prefill for d: a prefill worker, or any worker with
`prefill_from` "any"; d a worker that serves, of p's compatibility hash). A request
without a usable hint is routed by the kv-aware policy.

The intelligence lives outside the router: a benchmark's oracle, which knows each request's
tenant or conversation and the workers' cache sizes, assigns requests and sends the
assignment as the hint (the router's `X-Tandem-Worker` header). Eligibility and admission
still apply: a hint naming a worker that may not take the request falls back to kv-aware.
The chosen worker still pulls a cached prefix when a holder has more of it and pulls are on.
"""

from __future__ import annotations

from services.router.routing.candidates import Candidates
from services.router.routing.config import KvAwareConfig
from services.router.routing.plan import Selection
from services.router.routing.policies.kv_aware import KvAwarePolicy
from services.router.routing.policy import PolicySpec
from services.router.routing.request import RouteRefusal


class PinnedPolicy:
    def __init__(self, fallback: KvAwareConfig) -> None:
        self._fallback = KvAwarePolicy(fallback)

    def select(self, candidates: Candidates) -> Selection | RouteRefusal:
        hint = candidates.request.route_hint or ""
        prefill_id, _, decode_id = hint.rpartition(">")
        eligible = candidates.eligible
        decode = next((worker for worker in eligible.serving if worker.worker_id == decode_id), None)
        if decode is not None and not prefill_id:
            return Selection("pinned", decode)
        prefill = next((worker for worker in eligible.prefill if worker.worker_id == prefill_id), None)
        if decode is not None and prefill is not None and prefill is not decode \
                and prefill.compat_hash == decode.compat_hash:
            return Selection("pinned", decode, prefill=prefill)
        return self._fallback.select(candidates)


PINNED = PolicySpec("pinned", "benchmarks: the worker (or p>d pair) the request's route hint names (an oracle's pick)",
                    lambda routing: PinnedPolicy(routing.kv_aware))
