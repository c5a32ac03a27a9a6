"""A weakly cached prompt's home: where a prompt that no worker holds most of goes. Pure.

Without a home, a tenant whose prefix was evicted lands wherever the load is lowest at that
instant, and over time on every worker: under KV pressure each worker then sees more
tenants than its cache holds, and LRU evicts everyone's prefixes (churn). With a home, such
prompts go back to one worker per prefix, whose cache then keeps its own tenants:

1. the prefix's learned home (`homes.PrefixHomes`: the worker that served it last), unless
   that one cannot take the request, or `HomeHints.leave` says otherwise: `LEAVE` where the
   home is overcommitted (the prefixes homed there draw more than one worker's part of the
   traffic) and this prefix is a minor tenant there (the prompt must be computed anyway, so
   moving it costs nothing, and the home sheds load for its major tenants: the partition
   rebalances as the prefixes' shares become known); `IF_BUSY` where the shares are
   unknown, the prefix draws more than one worker can carry, or at most half of its home's
   traffic: then a busy home (its queued prefill far above the mean) is left too; `STAY`
   otherwise, busy or not (a moment's queue is no reason to move its major tenant off a
   worker that can carry it). A minor tenant of an overcommitted home leaves even while
   cached there (`rules.HomeRules.leaves`), for a worker with room for its prompt (or
   for any with room for its share where the home's prompts also need more KV than it
   holds): bounded affinity would keep its requests queueing there, and the tenants evicting
   one another, for as long as the traffic lasts;
2. otherwise a new home among the candidates that the prefix's share would not push past
   one worker's part of the traffic (where its share is known; all candidates when none
   has room: a moment's short queue does not draw a tenant onto a worker whose other
   tenants already fill it), costing at most `slack` more than the cheapest of them and
   queueing at most the mean: the one whose homed prefixes bring the smallest share of
   recent requests (a balanced partition by traffic), ties broken by rendezvous hashing of
   the prompt's first block (stable across processes, so router replicas agree when they
   know no more). A burst of distinct new prompts still spreads evenly (the mean bound).
   For a transient prefix (past the cluster's KV, recurring but not resident: it misses
   wherever it goes) the shares are of the recent work, a miss weighing several hits, and
   there is no cap: its home is where its misses are computed (`rules.HomeRules`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

Part = TypeVar("Part")


LEAVE, IF_BUSY, STAY = "leave", "if_busy", "stay"  # `HomeHints.leave`


def home_score(prefix_key: int, worker_id: str) -> int:
    """Rendezvous weight of `worker_id` for the prefix `prefix_key`: stable across processes."""
    digest = hashlib.blake2b(f"{prefix_key}:{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass(slots=True, unsafe_hash=True)
class HomeHints:  # read-only by convention (not frozen: built per request, and a frozen dataclass is slow to build)
    """What the router remembers about a prefix's home (`homes.PrefixHomes`)."""

    prefix_key: int
    home: str | None = None  # the worker that served the prefix last
    homed_share: Mapping[str, float] = field(default_factory=dict)  # per worker, its prefixes' traffic share
    leave: str = IF_BUSY  # LEAVE, IF_BUSY or STAY: when the learned home is given up
    # the prefix's own share and the most one worker should carry (`shares.share_cap`): a new
    # home is sought first among workers that stay under the cap with it (None: unknown)
    prefix_share: float | None = None
    share_cap: float | None = None
    # the workers where the prefix's prompt fits beside their resident homed prefixes' (a
    # resident prefix's new home is sought among them first); None: anywhere
    fits: frozenset[str] | None = None
    # the prefix must fit: a worker of `fits` with room for its share is preferred to one that
    # merely queues less than the mean (a moment's queue passes; an overfull cache thrashes)
    fit_first: bool = False

    def has_room(self, worker_id: str) -> bool:
        """Whether homing the prefix on `worker_id` keeps that worker's share under the cap."""
        if self.prefix_share is None or self.share_cap is None:
            return True
        return self.homed_share.get(worker_id, 0.0) + self.prefix_share <= self.share_cap

    def fits_on(self, worker_id: str) -> bool:
        return self.fits is None or worker_id in self.fits


def prefer_home(parts: Sequence[Part], cost: Callable[[Part], float], worker_id: Callable[[Part], str],
                queued: Callable[[Part], float], hints: HomeHints, slack: float, busy_factor: float,
                busy_margin: float) -> Part:
    """Of `parts` (non-empty): the learned home unless busy (queued prefill past `busy_factor`
    x the mean and `busy_margin` above it, where `hints.leave` is IF_BUSY) or to be left
    (`LEAVE`); else a new, balanced home among the near-cheapest of the workers queueing at
    most the mean with room for the prefix's share (`HomeHints.has_room`) and its prompt
    (`HomeHints.fits_on`; with `HomeHints.fit_first`, next any with room for both; then
    those with room for its share; all of them when none has room); the cheapest when none
    qualifies."""
    mean_queued = sum(queued(part) for part in parts) / len(parts)
    if hints.home is not None and hints.leave != LEAVE:
        busy = max(busy_factor * mean_queued, mean_queued + busy_margin) if hints.leave == IF_BUSY else float("inf")
        for part in parts:
            if worker_id(part) == hints.home and queued(part) <= busy:
                return part
    roomy = [part for part in parts if queued(part) <= mean_queued and hints.has_room(worker_id(part))]
    pool = [part for part in roomy if hints.fits_on(worker_id(part))]
    if not pool and hints.fit_first:
        pool = [part for part in parts if hints.has_room(worker_id(part)) and hints.fits_on(worker_id(part))]
    pool = pool or roomy or parts
    cheapest = min(pool, key=cost)
    near = [part for part in pool if cost(part) <= cost(cheapest) + slack and queued(part) <= mean_queued]
    if not near:
        return cheapest
    return min(near, key=lambda part: (hints.homed_share.get(worker_id(part), 0.0),
                                       -home_score(hints.prefix_key, worker_id(part))))
