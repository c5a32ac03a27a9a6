"""Read-only views of `homes.PrefixHomes` that a routing request carries
(`RouteRequest.homed_share`, `homed_tokens`, `resident_prefixes`). Pure.

Each is computed on access, not when the request is built: most requests are routed by
their cache hits and never ask, and one worker's figure costs less than every worker's.

Callers: `PrefixHomes.shares`, `tokens` and `residents` build them; the routing request
(`routing.request`) reads them.
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.router.routing.placement.homes import PrefixHomes


class LazyShares(Mapping[str, float]):
    def __init__(self, homes: PrefixHomes) -> None:
        self._homes = homes
        self._shares: dict[str, float] | None = None

    def _all(self) -> dict[str, float]:
        if self._shares is None:
            self._shares = self._homes.homed_share()
        return self._shares

    def __getitem__(self, worker_id: str) -> float:
        if self._shares is None:  # one worker's share costs O(1) (the copies' sums: once a request); all, O(workers)
            return self._homes.worker_share(worker_id)
        return self._shares[worker_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


class Residents(Container[int]):
    def __init__(self, homes: PrefixHomes) -> None:
        self._homes = homes

    def __contains__(self, prefix_key: object) -> bool:
        return isinstance(prefix_key, int) and self._homes.resident(prefix_key)

    @property
    def limited(self) -> bool:
        return self._homes.limited()

    def transient(self, prefix_key: int) -> bool:
        return self._homes.transient(prefix_key)

    def work_shares(self) -> dict[str, float]:
        return self._homes.work_shares()

    def work_share(self, prefix_key: int) -> float | None:
        return self._homes.work_share(prefix_key)


class HomedTokens(Mapping[str, int]):
    def __init__(self, homes: PrefixHomes, resident: bool) -> None:
        self._homes = homes
        self._resident = resident

    def __getitem__(self, worker_id: str) -> int:
        return self._homes.homed_tokens(worker_id, resident=self._resident)

    def __iter__(self) -> Iterator[str]:
        return iter(self._homes.token_workers())

    def __len__(self) -> int:
        return len(self._homes.token_workers())
