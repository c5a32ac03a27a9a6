"""Random, a baseline for benchmarks: the request's draw (from the router's generator,
seeded by `RoutingConfig.seed`) picks one eligible serving worker, whatever its cache holds.

Only the choice of worker is the baseline's: eligibility and admission still apply, and
the chosen worker still pulls a cached prefix from a holder when one has more of it.
"""

from __future__ import annotations

from services.router.routing.candidates import Candidates
from services.router.routing.plan import Selection
from services.router.routing.policy import PolicySpec


class RandomPolicy:
    def select(self, candidates: Candidates) -> Selection:
        ordered = sorted(candidates.eligible.serving, key=lambda worker: worker.worker_id)
        index = min(int(candidates.request.draw * len(ordered)), len(ordered) - 1)
        return Selection("baseline", ordered[index])


RANDOM = PolicySpec("random", "baseline: a seeded random worker", lambda routing: RandomPolicy())
