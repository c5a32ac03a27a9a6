"""One `PrefixHomes`' resident prefixes: the workers' KV pools they are ranked against, the
ranking kept between two rankings, and the tokens each home keeps for its residents. Pure.

Where the live prefixes need more KV than the cluster's pools hold (`PrefixHomes.limited`),
`residency.rank_residents` picks the ones that stay resident, anew every `RESIDENCY_EVERY`
routed requests and at once after a pool or membership change. Between two rankings, a
resident routed again stays resident at its (new) home, and one that is dropped (no longer
live, forgotten, or routed again until it is) leaves the count of its home's tokens.

Caller: `homes.PrefixHomes`, which keeps the live prefixes and hands them over to rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from services.router.routing.placement.residency import rank_residents

RESIDENCY_EVERY = 16  # routed requests between two rankings of the resident prefixes


class ResidentPrefixes:
    __slots__ = ("keys", "tokens", "_capacity", "_ranked_at")

    def __init__(self) -> None:
        self.keys: set[int] | None = None  # None: not `limited`, every live prefix counts
        self.tokens: dict[str, int] = {}  # worker -> the tokens of its resident homed prefixes
        self._capacity: dict[str, int] = {}  # worker -> its KV pool, in tokens
        self._ranked_at: int | None = None  # None: to be ranked (capacity or membership changed)

    def set_capacity(self, worker_id: str, kv_tokens: int) -> None:
        """`worker_id`'s KV pool holds `kv_tokens` (0: unknown); ranked anew when next asked."""
        if kv_tokens > 0:
            self._capacity[worker_id] = kv_tokens
        else:
            self._capacity.pop(worker_id, None)
        self.keys, self._ranked_at = None, None

    def forget(self, worker_id: str) -> None:
        """A worker left: its pool counts no more; ranked anew when next asked."""
        self._capacity.pop(worker_id, None)
        self.keys, self._ranked_at = None, None

    def holds(self, prefix_key: int) -> bool:
        return self.keys is not None and prefix_key in self.keys

    def keep(self, prefix_key: int, home: str, tokens: int) -> None:
        """A resident routed again stays resident, at `home`, until the next ranking."""
        assert self.keys is not None, "only a resident is kept"
        self.keys.add(prefix_key)
        self.tokens[home] = self.tokens.get(home, 0) + tokens

    def drop(self, prefix_key: int, home: str, tokens: int) -> None:
        """A prefix's entry is replaced or dropped: out of its home's resident sum if resident."""
        if self.keys is not None and prefix_key in self.keys:
            self.keys.discard(prefix_key)
            self.tokens[home] -= tokens

    def rank(self, step: int, live_tokens: Mapping[str, int],
             live: Callable[[], Iterable[tuple[int, str, float, int]]]) -> set[int] | None:
        """The resident prefixes at `step`, or None where every live one counts (not `limited`:
        the live prefixes' tokens, per home in `live_tokens`, fit the pools, or no pool is
        known), ranked anew when `RESIDENCY_EVERY` requests have been routed since the last
        ranking; `live` gives the live prefixes as `rank_residents` reads them."""
        if self._ranked_at is not None and step - self._ranked_at < RESIDENCY_EVERY:
            return self.keys
        self._ranked_at = step
        capacity = sum(self._capacity.values())
        if not capacity or sum(live_tokens.values()) <= capacity:
            self.keys = None
            return None
        self.keys, self.tokens = rank_residents(live(), capacity, self.keys or frozenset())
        return self.keys
