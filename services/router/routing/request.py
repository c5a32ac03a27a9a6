"""What routing is asked, and its answer when no worker may serve: plain data.

The dispatcher builds a `RouteRequest` per attempt from the request and the KV view's
`PromptCache`; `decide()` answers a `RoutePlan` (`plan`), a `RouteRefusal`, or None (no
worker can take the request now: the caller waits).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from services.router.routing.placement.home_views import Residents

RefusalReason = Literal[
    "overloaded",  # every candidate worker is past its queue limit: try again later (429)
    "cache_threshold",  # no worker holds enough of the prompt for the request's cache-hit threshold
]


@dataclass(frozen=True, slots=True)
class RouteRequest:
    model: str
    prompt_tokens: int  # what a prefill worker must fit (plus the one token it generates)
    total_tokens: int  # prompt tokens + max_tokens: what must fit in a serving worker's context
    # Per worker, the leading prompt tokens it holds per the KV index: `cached_tokens` counts
    # blocks predicted for requests just routed there, `held_tokens` only reported ones.
    cached_tokens: Mapping[str, int] = field(default_factory=dict)
    held_tokens: Mapping[str, int] = field(default_factory=dict)
    # Per worker holding some of its `cached_tokens` outside its first KV tier (host memory,
    # disk): those tokens per tier, which a hit must load (`cost.tier_load_cost`)
    tier_tokens: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    cache_hit_threshold: float = 0.0  # decode-first when > 0
    admit: bool = True  # False: already admitted once (a request resumed elsewhere)
    # the request asks for its prompt's log-probabilities: one engine computes the whole
    # prompt and serves it whole, never a prefill/decode pair
    one_engine: bool = False
    # the request samples on its output history (penalties, bad words, a seeded stream, a
    # grammar): a decode part replays the first token, so the prefill part goes first (pull)
    replays: bool = False
    draw: float = 0.0  # a uniform draw in [0, 1) from the caller's seeded generator (random policy)
    route_hint: str | None = None  # a worker id the client asked for (only the pinned policy reads it)
    prefix_key: int | None = None  # the hash of the prompt's first block (its prefix's home); None: shorter
    # Per worker, seconds since its least recently used cached prefix was last routed there
    # (`recency.CacheRecency`; None or absent: unknown). May be computed on access.
    victim_age_s: Mapping[str, float | None] = field(default_factory=dict)
    # The worker that served this prefix last, and per worker the share of recent requests
    # whose prefixes live there (`placement.homes.PrefixHomes`); empty: unknown
    home_worker: str | None = None
    homed_share: Mapping[str, float] = field(default_factory=dict)
    prefix_share: float | None = None  # the prefix's share of recent requests (`placement.homes`); None: unknown
    # per worker, the KV tokens its live homed prefixes keep there (`placement.homes.PrefixHomes.tokens`);
    # absent: unknown
    homed_tokens: Mapping[str, int] = field(default_factory=dict)
    # where the live prefixes need more KV than the cluster holds (`limited`), the ones
    # whose KV is worth keeping on their homes (`placement.homes.PrefixHomes.resident`); None: unknown
    resident_prefixes: Residents | None = None
    adapter: str = ""  # the model's LoRA adapter it is served with ("": the base model; `adapters`)

    @property
    def kv_limited(self) -> bool:
        """Whether only some of the live prefixes can stay cached in the cluster."""
        return self.resident_prefixes is not None and self.resident_prefixes.limited

    @property
    def resident(self) -> bool:
        """Whether the prompt's prefix is resident (True where unknown)."""
        return self.prefix_key is None or self.resident_prefixes is None or self.prefix_key in self.resident_prefixes

    @property
    def transient(self) -> bool:
        """Whether the prompt's prefix recurs but is not resident where the cluster is limited
        (`placement.homes.PrefixHomes.transient`): it misses wherever it goes."""
        return (self.prefix_key is not None and self.resident_prefixes is not None
                and self.resident_prefixes.transient(self.prefix_key))

    @property
    def homed_work(self) -> Mapping[str, float]:
        """Per worker, its homed prefixes' share of the recent work, misses weighing more than
        hits (`placement.homes.PrefixHomes.work_shares`; empty: unknown)."""
        return self.resident_prefixes.work_shares() if self.resident_prefixes is not None else {}

    @property
    def prefix_work(self) -> float | None:
        """The prefix's share of the recent work (`placement.homes.PrefixHomes.work_share`; None: unknown)."""
        if self.prefix_key is None or self.resident_prefixes is None:
            return None
        return self.resident_prefixes.work_share(self.prefix_key)

    @property
    def max_tokens(self) -> int:
        return self.total_tokens - self.prompt_tokens


@dataclass(frozen=True, slots=True)
class RouteRefusal:
    reason: RefusalReason
    worker_id: str | None = None  # cache_threshold: the best-cached worker
    cached_tokens: int = 0  # ... and how much of the prompt it holds
