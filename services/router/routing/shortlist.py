"""Which workers a large fleet's request is costed against. Pure.

Costing every worker is linear in the fleet (a view, an eligibility check and a cost each):
at a thousand workers that is milliseconds per request in Python. Past `shortlist_workers`
workers, a request is costed only against the workers that can matter to it:
- the holders of its longest cached prefixes (at most half the shortlist, longest first):
  affinity and pulls need nobody else;
- its prefix's home (`placement.homes`), for a prompt whose KV was evicted;
- workers drawn uniformly at random to fill the shortlist: for load, the best of a few
  random choices balances almost as well as the best of all ("power of d choices"), and
  different requests see different samples, so no worker is left out for long.

The caller falls back to every worker when the shortlist yields no eligible one, or only
workers past their queue limit (a refusal must speak for the whole fleet).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence

from services.router.routing.config import RoutingConfig
from services.router.routing.request import RouteRequest


def shortlist(worker_ids: Sequence[str], request: RouteRequest, routing: RoutingConfig,
              rng: random.Random) -> list[str] | None:
    """The worker ids to cost `request` against; None: all of them (a small fleet, or off)."""
    size = routing.shortlist_workers
    if size <= 0 or len(worker_ids) <= size:
        return None
    held = request.cached_tokens
    if len(held) > size // 2:
        holders = heapq.nlargest(size // 2, held, key=lambda worker_id: (held[worker_id], worker_id))
    else:
        holders = [worker_id for worker_id, tokens in held.items() if tokens > 0]
    chosen = dict.fromkeys(holders)
    if request.placement.home is not None:
        chosen[request.placement.home] = None
    draws = 0
    while len(chosen) < size and draws < 4 * size:  # a few draws more than needed cover repeats
        chosen[worker_ids[rng.randrange(len(worker_ids))]] = None
        draws += 1
    return list(chosen)
