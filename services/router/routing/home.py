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
   unknown or the prefix draws more than one worker can carry: then a busy home (its
   queued prefill far above the mean) is left too; `STAY` otherwise, busy or not (a
   moment's queue is no reason to move a tenant its worker can carry);
2. otherwise a new home among the candidates costing at most `slack` more than the cheapest
   and queueing at most the mean: the one whose homed prefixes bring the smallest share of
   recent requests (a balanced partition by traffic), ties broken by rendezvous hashing of
   the prompt's first block (stable across processes, so router replicas agree when they
   know no more). A burst of distinct new prompts still spreads evenly (the mean bound).
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


@dataclass(frozen=True, slots=True)
class HomeHints:
    """What the router remembers about a prefix's home (`homes.PrefixHomes`)."""

    prefix_key: int
    home: str | None = None  # the worker that served the prefix last
    homed_share: Mapping[str, float] = field(default_factory=dict)  # per worker, its prefixes' traffic share
    leave: str = "if_busy"  # LEAVE, IF_BUSY or STAY: when the learned home is given up


def prefer_home(parts: Sequence[Part], cost: Callable[[Part], float], worker_id: Callable[[Part], str],
                queued: Callable[[Part], float], hints: HomeHints, slack: float, busy_factor: float,
                busy_margin: float) -> Part:
    """Of `parts` (non-empty): the learned home unless busy (queued prefill past `busy_factor`
    x the mean and `busy_margin` above it, where `hints.leave` is IF_BUSY) or to be left
    (`LEAVE`); else a
    new, balanced home among the near-cheapest; the cheapest when none qualifies."""
    mean_queued = sum(queued(part) for part in parts) / len(parts)
    if hints.home is not None and hints.leave != LEAVE:
        busy = max(busy_factor * mean_queued, mean_queued + busy_margin) if hints.leave == IF_BUSY else float("inf")
        for part in parts:
            if worker_id(part) == hints.home and queued(part) <= busy:
                return part
    cheapest = min(parts, key=cost)
    near = [part for part in parts if cost(part) <= cost(cheapest) + slack and queued(part) <= mean_queued]
    if not near:
        return cheapest
    return min(near, key=lambda part: (hints.homed_share.get(worker_id(part), 0.0),
                                       -home_score(hints.prefix_key, worker_id(part))))
