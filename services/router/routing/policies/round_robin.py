"""Round-robin, a baseline for benchmarks: the eligible serving worker this router picked
longest ago serves the request alone, whatever its cache holds.

Only the choice of worker is the baseline's: eligibility and admission still apply, and
the chosen worker still pulls a cached prefix from a holder when one has more of it.
"""

from __future__ import annotations

from services.router.routing.candidates import Candidates
from services.router.routing.plan import Selection
from services.router.routing.policy import PolicySpec


class RoundRobinPolicy:
    def select(self, candidates: Candidates) -> Selection:
        ordered = sorted(candidates.eligible.serving, key=lambda worker: worker.worker_id)
        return Selection("baseline", min(ordered, key=lambda worker: worker.last_routed))


ROUND_ROBIN = PolicySpec("round-robin", "baseline: the worker picked longest ago", lambda routing: RoundRobinPolicy())
