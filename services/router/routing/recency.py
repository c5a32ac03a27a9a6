"""How recently each worker's cached prefixes were used: what a full cache would lose. Pure.

Under KV pressure every worker's cache is full, so any new prefix evicts one, and the plain
eviction cost (tokens pushed out) is the same everywhere: it cannot tell a worker whose
least recently used prefix was last asked for a second ago (a tenant that will be back at
once, and miss) from one whose oldest prefix has not been asked for in a minute. Engines
evict least recently used blocks first, so a worker's *victim* is its least recently used
prefix, and the age of that use says how much evicting it costs: the router, which places
every request, keeps per worker the prefixes it sent there (keyed by the prompt's first
block) in order of last use.

`victim_value` turns the ages into a weight in [0, 1] for the eviction cost: the worker with
the youngest victim weighs 1, one whose victim is ten times older weighs 0.1. New prefixes
then land where the coldest prefix is, and the cluster as a whole evicts its least recently
used prefix, as one LRU cache would, instead of every worker churning its own tenants.
Scale-free: only ratios of ages count, so no timescale is tuned to a workload.

Callers: the router's KV view (`touch` on each routed prompt, ages on demand) and the cost
model (`candidates.Candidates`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping

MAX_TRACKED_PER_WORKER = 4096  # prefixes remembered per worker; the oldest beyond are forgotten
MIN_AGE_S = 1e-3  # ages below this count as this (a prefix used "now")


class CacheRecency:
    """Per worker, the prefix keys routed there, least recently used first."""

    def __init__(self, max_tracked: int = MAX_TRACKED_PER_WORKER) -> None:
        self._max_tracked = max_tracked
        self._last_use: dict[str, OrderedDict[int, float]] = {}

    def touch(self, worker_id: str, prefix_key: int, now: float) -> None:
        uses = self._last_use.setdefault(worker_id, OrderedDict())
        uses[prefix_key] = now
        uses.move_to_end(prefix_key)
        if len(uses) > self._max_tracked:
            uses.popitem(last=False)

    def forget(self, worker_id: str) -> None:
        self._last_use.pop(worker_id, None)

    def victim_age(self, worker_id: str, holds: Callable[[int], bool], now: float) -> float | None:
        """Seconds since the worker's least recently used prefix that it still holds was last
        routed there; prefixes it no longer holds are dropped on the way. None: none known."""
        uses = self._last_use.get(worker_id)
        while uses:
            prefix_key, used_at = next(iter(uses.items()))
            if holds(prefix_key):
                return max(MIN_AGE_S, now - used_at)
            del uses[prefix_key]
        return None


def victim_values(ages: Mapping[str, float | None]) -> dict[str, float]:
    """Per worker, the weight of evicting its victim: the youngest victim age among `ages`
    over this worker's (1 for the youngest, and for a worker whose victim is unknown)."""
    known = [age for age in ages.values() if age is not None]
    if not known:
        return {worker_id: 1.0 for worker_id in ages}
    youngest = min(known)
    return {worker_id: 1.0 if age is None else min(1.0, youngest / age) for worker_id, age in ages.items()}
