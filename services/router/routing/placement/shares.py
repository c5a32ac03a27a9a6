"""A prefix's share of the traffic and what one worker may carry of it. Pure.

The shares' arithmetic that prefix placement and replication share: the most of the
requests one worker should carry (`share_cap`), how many workers a prefix's share needs
(`copies_needed`), a worker overcommitted by its homed prefixes and a minor tenant there
(`minor_tenant`, `homes_overflow`), and when a prefix is hot enough to copy
(`prefix_is_hot`, `holders_overcommitted`).

Callers: `rules.HomeRules` (where a prompt's prefix goes) and the kv-aware policy
(`policies.cheapest.Cheapest`: whether its prefix is replicated).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from services.router.routing.config import RoutingConfig
from services.router.routing.view import WorkerView

HOT_MIN_EXCESS = 2  # requests above the mean a holder must carry before its prefix counts as hot


def share_cap(workers: int, slack: float) -> float:
    """The most of the requests one of `workers` should carry: `(1 + slack) / workers`."""
    return (1.0 + slack) / workers


def copies_needed(share: float, workers: int, slack: float) -> int:
    """How many workers a prefix drawing `share` of the requests needs, when each carries at
    most `share_cap` of them (at least one, at most `workers`)."""
    if workers <= 0:
        return 0
    return min(workers, max(1, math.ceil(share / share_cap(workers, slack) - 1e-9)))


def homes_overflow(worker: WorkerView, homed_tokens: int | None) -> bool:
    """Whether the prefixes homed on `worker` keep more KV than its pool holds (so they evict
    one another there); False where either is unknown."""
    return homed_tokens is not None and worker.kv_capacity_tokens > 0 and homed_tokens > worker.kv_capacity_tokens


def minor_tenant(prefix_share: float, homed_share: float, workers: int, slack: float) -> bool:
    """Whether a worker whose homed prefixes draw `homed_share` of the recent requests is
    overcommitted (over `share_cap`) and a prefix drawing `prefix_share` is a minor tenant
    there (at most half of it, and under half the cap), which may leave for the major ones'
    sake."""
    cap = share_cap(workers, slack)
    return homed_share > cap and prefix_share <= homed_share / 2 and prefix_share < cap / 2


def holders_overcommitted(routing: RoutingConfig, holders: Sequence[WorkerView], workers: int,
                          prefix_share: float | None) -> bool:
    """Whether the prefix draws more of the traffic than its holders can carry, each at most
    `(1 + replica_share_slack) / workers` of it (`copies_needed`), so it may be copied.
    True when its share is unknown or `replica_share_slack` is None."""
    slack = routing.replica_share_slack
    if prefix_share is None or slack is None:
        return True
    return len(holders) < copies_needed(prefix_share, workers, slack)


def prefix_is_hot(routing: RoutingConfig, workers: Sequence[WorkerView], cached_tokens: Mapping[str, int],
                  prompt_tokens: int, prefix_share: float | None = None) -> bool:
    """Every one of `workers` holding (or predicted to hold) the longest cached prefix of the
    prompt is overloaded, relative to the mean of `workers`: it carries more than
    `hot_load_factor` x their mean requests (and at least `HOT_MIN_EXCESS` more), or more
    than `hot_load_factor` x their mean queued prefill tokens (and at least one prompt's
    worth more); and, when the prefix's share of the recent requests is known
    (`prefix_share`), its holders are overcommitted (`holders_overcommitted`). The prefix
    then needs another copy. False without a cached prefix among them, or with
    `hot_load_factor` 0."""
    if routing.hot_load_factor <= 0 or not workers:
        return False
    by_id = {worker.worker_id: worker for worker in workers}
    longest = max((min(tokens, prompt_tokens) for worker_id, tokens in cached_tokens.items() if worker_id in by_id),
                  default=0)
    if longest <= 0:
        return False
    holders = [by_id[worker_id] for worker_id, tokens in cached_tokens.items()
               if worker_id in by_id and min(tokens, prompt_tokens) == longest]
    if not holders_overcommitted(routing, holders, len(workers), prefix_share):
        return False
    mean_load = sum(worker.predicted_load for worker in workers) / len(workers)
    mean_queued = sum(worker.predicted_prefill_tokens for worker in workers) / len(workers)
    load_bound = max(routing.hot_load_factor * mean_load, mean_load + HOT_MIN_EXCESS)
    queued_bound = max(routing.hot_load_factor * mean_queued, mean_queued + prompt_tokens)

    def overloaded(worker: WorkerView) -> bool:
        return worker.predicted_load >= load_bound or worker.predicted_prefill_tokens >= queued_bound

    return all(overloaded(holder) for holder in holders)
