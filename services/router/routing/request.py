"""What routing is asked, and its answer when no worker may serve: plain data.

The routing state (`flows.routing_state`) builds a `RouteRequest` per attempt from the request, the KV view's
`PromptCache` and a snapshot of the prefix's placement (`placement.snapshot`); `decide()`
answers a `RoutePlan` (`plan`), a `RouteRefusal`, or None (no worker can take the request
now: the caller waits).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from services.router.routing.placement.snapshot import PrefixPlacement

RefusalReason = Literal[
    "overloaded",  # every candidate worker is past its queue limit: try again later (429)
    "cache_threshold",  # no worker holds enough of the prompt for the request's cache-hit threshold
]


@dataclass(slots=True, unsafe_hash=True)
class RouteRequest:  # read-only by convention (not frozen: built per request, and a frozen dataclass is slow to build)
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
    # the prompt's tokens in full blocks: the KV its prefix keeps where it is computed
    block_tokens: int = 0
    # what the prefix's placement says of it (`placement.snapshot`: its home, the shares, its
    # residency), taken for this request; the defaults: nothing known
    placement: PrefixPlacement = field(default_factory=PrefixPlacement)
    adapter: str = ""  # the model's LoRA adapter it is served with ("": the base model; `adapters`)

    @property
    def max_tokens(self) -> int:
        return self.total_tokens - self.prompt_tokens


@dataclass(frozen=True, slots=True)
class RouteRefusal:
    reason: RefusalReason
    worker_id: str | None = None  # cache_threshold: the best-cached worker
    cached_tokens: int = 0  # ... and how much of the prompt it holds
