"""One model's KV namespace: its workers' KV index and cache recency. Pure.

The router keeps one per served model (`view.KvView.model`): a worker's KV events go only
into its model's index, and a prompt of a model is matched only against that index, so a
prefix hit can never cross models, even where two models' tokenizers give the same token
ids (and so the same chain hashes). Recency is per model too. (The prefixes' homes are
the placement's, `routing.placement`, kept per model beside this by the routing state,
`flows.routing_state`.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from services.router.kv.index import KvIndex, block_hashes_for
from services.router.routing.recency import CacheRecency
from shared.block_hash import chain_root, request_chain
from shared.schemas import KvTransferParams
from shared.schemas.kv_events import DEVICE_TIER, HOST_TIER, KvTier


class PrefixSource:
    __slots__ = ("worker_id", "block_hashes")

    def __init__(self, worker_id: str, block_hashes: list[int]) -> None:
        self.worker_id = worker_id
        self.block_hashes = block_hashes

    def as_params(self, **others: object) -> KvTransferParams:
        return KvTransferParams(prefix_holder=self.worker_id, prefix_hashes=self.block_hashes, **others)


@dataclass(slots=True, unsafe_hash=True)
class PromptCache:  # read-only by convention (not frozen: built per request, and a frozen dataclass is slow to build)
    """What the KV index says about one prompt, in tokens."""

    chains: dict[int, list[int]]  # block size -> the prompt's Tandem hash chain
    cached_tokens: dict[str, int]  # per worker: leading tokens held or predicted (speculative)
    # per worker: leading tokens it reported holding and can lend (in its first tier, and in
    # its host tier too where it lends that: `tiered_prefix`)
    held_tokens: dict[str, int]
    # per worker holding some of its cached tokens outside its first tier: those tokens per tier
    tier_tokens: dict[str, dict[KvTier, int]] = field(default_factory=dict)

    @property
    def prefix_key(self) -> int | None:
        """The hash of the prompt's first block (smallest block size in use); None when the
        prompt is shorter than a block."""
        return self.chains[min(self.chains)][0] if self.chains else None

    @property
    def block_tokens(self) -> int:
        """The prompt's tokens in full blocks: the KV its prefix keeps where it is computed."""
        return max((size * len(chain) for size, chain in self.chains.items()), default=0)


def tiered_prefix(chain: Sequence[int], blocks: int, held: int, tiers: Mapping[int, KvTier],
                  tier_aware: bool, lends_host_tier: bool = False) -> tuple[int, int, dict[KvTier, int]]:
    """A worker's `blocks` leading blocks of `chain` (`held` of them reported), some in slower
    tiers (`tiers`): (leading blocks that count as cached, of them reported and lendable, which
    a pull can read: in the first tier, or in the host tier too where the worker lends it
    (`EngineCapabilities.host_tier_lending`: it loads them back to lend them); and blocks per
    slower tier). Tier-blind, a block outside the first tier ends the cached prefix, as if it
    were gone."""
    first_tier_run = next((position for position in range(blocks) if chain[position] in tiers), blocks)
    if not tier_aware:
        return first_tier_run, min(held, first_tier_run), {}
    lendable = first_tier_run
    if lends_host_tier:
        lendable = next((position for position in range(blocks)
                         if tiers.get(chain[position], DEVICE_TIER) not in (DEVICE_TIER, HOST_TIER)), blocks)
    held = min(held, lendable)
    return blocks, held, dict(Counter(tiers[block_hash] for block_hash in chain[:blocks] if block_hash in tiers))


class VictimAges(Mapping[str, "float | None"]):
    """`CacheRecency.victim_age` per worker, computed on first access (only the workers whose
    cache a prompt would overflow are asked) against the KV index."""

    def __init__(self, recency: CacheRecency, index: KvIndex, now: float) -> None:
        self._recency = recency
        self._index = index
        self._now = now
        self._ages: dict[str, float | None] = {}

    def __getitem__(self, worker_id: str) -> float | None:
        if worker_id not in self._ages:
            self._ages[worker_id] = self._recency.victim_age(
                worker_id, lambda prefix_key: self._index.holds(worker_id, prefix_key), self._now)
        return self._ages[worker_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._ages)

    def __len__(self) -> int:
        return len(self._ages)


class ModelKv:
    """What the router knows of one model's KV: where its workers' blocks live (real and
    predicted), and when each worker last used them."""

    def __init__(self, *, verify_hashes: bool = False, tier_aware: bool = True) -> None:
        self.tier_aware = tier_aware  # off: blocks outside a worker's first tier count as not cached
        self.index = KvIndex(verify_hashes=verify_hashes, trust_chains=True)  # workers send Tandem chains
        self.recency = CacheRecency()
        self._block_sizes: dict[str, int] = {}
        self._lends_host_tier: set[str] = set()  # workers whose host tier a prefix pull may read

    def worker_joined(self, worker_id: str, block_size: int, *, lends_host_tier: bool = False) -> None:
        self._block_sizes[worker_id] = block_size
        if lends_host_tier:
            self._lends_host_tier.add(worker_id)
        else:
            self._lends_host_tier.discard(worker_id)
        self.index.add_worker(worker_id, block_size)

    def worker_left(self, worker_id: str) -> None:
        self._block_sizes.pop(worker_id, None)
        self._lends_host_tier.discard(worker_id)
        self.index.remove_worker(worker_id)
        self.recency.forget(worker_id)

    @property
    def worker_ids(self) -> list[str]:
        return list(self._block_sizes)

    def prompt_cache(self, prompt_ids: list[int], now: float, *, adapter: str = "", cache_salt: str = "",
                     images: Sequence[tuple[str, int, int]] = ()) -> PromptCache:
        """Where the prompt's leading blocks live (predictions due by `now` dropped first):
        one hash chain per block size in use, from the root of the request's LoRA `adapter`
        and `cache_salt` (so a prefix computed with another adapter or salt, or with none,
        never matches), the blocks that hold an image's tokens salted by it (`images`:
        `(identifier, start, length)`)."""
        self.index.expire(now)
        chains: dict[int, list[int]] = {}
        cached: dict[str, int] = {}
        held: dict[str, int] = {}
        tiered: dict[str, dict[KvTier, int]] = {}
        root = chain_root(adapter, cache_salt)
        for block_size in set(self._block_sizes.values()):
            if len(prompt_ids) < block_size:
                continue
            chain = chains[block_size] = (request_chain(prompt_ids, block_size, adapter=adapter, cache_salt=cache_salt,
                                                        images=images)
                                          if images else block_hashes_for(prompt_ids, block_size, parent_hash=root))
            for worker_id, blocks in self.index.match(chain).items():
                if self._block_sizes.get(worker_id) != block_size:
                    continue
                held_blocks = self.index.held_prefix(worker_id, chain, blocks)
                tiers = self.index.tiers(worker_id)
                if tiers:
                    blocks, held_blocks, per_tier = tiered_prefix(chain, blocks, held_blocks, tiers, self.tier_aware,
                                                                  worker_id in self._lends_host_tier)
                    if per_tier:
                        tiered[worker_id] = {tier: count * block_size for tier, count in per_tier.items()}
                    if not blocks:
                        continue
                cached[worker_id] = blocks * block_size
                held[worker_id] = held_blocks * block_size
        return PromptCache(chains, cached, held, tiered)

    def prefix_source(self, cache: PromptCache, holder_id: str, tokens: int) -> PrefixSource | None:
        """The blocks covering the prompt's first `tokens` tokens, to pull from `holder_id`."""
        block_size = self._block_sizes.get(holder_id)
        if block_size is None or block_size not in cache.chains or tokens < block_size:
            return None
        return PrefixSource(holder_id, cache.chains[block_size][: tokens // block_size])

    def victim_ages(self, now: float) -> VictimAges:
        """Per worker (on access), seconds since its least recently used prefix was routed."""
        return VictimAges(self.recency, self.index, now)

    def predict(self, worker_id: str, cache: PromptCache, now: float, ttl_s: float) -> None:
        """`worker_id` was just routed the prompt: count its blocks there until its own events
        arrive (or `ttl_s` passes), so sibling requests follow it; the prompt's prefix is now
        its most recently used one."""
        if cache.prefix_key is not None:
            self.recency.touch(worker_id, cache.prefix_key, now)
        block_size = self._block_sizes.get(worker_id)
        if block_size is not None and block_size in cache.chains:
            self.index.add_speculative(worker_id, cache.chains[block_size], expires_at=now + ttl_s)
