"""A cold prompt's home: where a prompt that no worker holds any of goes, among the workers
that cost about the same. Pure.

Without a home, a tenant whose prefix was evicted everywhere lands wherever the load is
lowest at that instant, and over time on every worker: under KV pressure each worker then
sees more tenants than its cache holds, and LRU evicts everyone's prefixes (churn). With a
home, such prompts land on one worker per prefix (rendezvous hashing of the prompt's first
block over the candidate workers, so adding or losing a worker moves only its own
prefixes), whose cache then keeps its own tenants. The load bound: only candidates whose
cost is within `home_slack_tokens` of the cheapest, and whose queued prefill is at most the
candidates' mean, qualify (consistent hashing with bounded loads): a busy home is skipped,
and a burst of distinct cold prompts still spreads evenly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TypeVar

Part = TypeVar("Part")


def home_score(prefix_key: int, worker_id: str) -> int:
    """Rendezvous weight of `worker_id` for the prefix `prefix_key`: stable across processes."""
    digest = hashlib.blake2b(f"{prefix_key}:{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def prefer_home(parts: Sequence[Part], cost: Callable[[Part], float], worker_id: Callable[[Part], str],
                queued: Callable[[Part], float], prefix_key: int, slack: float) -> Part:
    """Of `parts` (non-empty), the one whose worker is the prefix's home among those costing at
    most `slack` more than the cheapest with at most the mean `queued` work; the cheapest
    when none qualifies."""
    cheapest = min(parts, key=cost)
    mean_queued = sum(queued(part) for part in parts) / len(parts)
    near = [part for part in parts if cost(part) <= cost(cheapest) + slack and queued(part) <= mean_queued]
    if not near:
        return cheapest
    return max(near, key=lambda part: home_score(prefix_key, worker_id(part)))
