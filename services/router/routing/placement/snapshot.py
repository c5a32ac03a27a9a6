"""What the placement says about one request's prefix: `PrefixPlacement`, a read-only snapshot
that goes into the routing request (`RouteRequest.placement`). Pure.

`Placement.snapshot` takes it as of one routed request. Its per-worker figures and the
residency are computed on first read, not when the snapshot is taken: most requests are
routed by their cache hits and never ask, one worker's figure costs less than every
worker's, and the resident prefixes are ranked again only when read (so when they are
ranked stays as it was). They read `homes.PrefixHomes` as of the snapshot: reading one after
the placement changed (another request recorded, a worker joined or left) is a bug, and
asserted; the routing state reads it between taking it and committing the plan, with no await.

Callers: `placement.Placement.snapshot` builds it (`snapshot_of`); routing (`routing.request`,
the home rules in `rules`, the cost model, the shortlist) reads it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.router.routing.placement.homes import PrefixHomes


class _AsOf:
    """A read of `homes` as of now: later reads assert that `homes` has not changed since."""

    def __init__(self, homes: PrefixHomes) -> None:
        self._homes = homes
        self._changes = homes.changes

    @property
    def homes(self) -> PrefixHomes:
        assert self._homes.changes == self._changes, "a placement snapshot read after the placement changed"
        return self._homes


class HomedShares(_AsOf, Mapping[str, float]):
    """`PrefixHomes.homed_share`: one worker's share costs O(1) (the copies' sums: once a
    request), all of them O(workers), computed on first iteration."""

    def __init__(self, homes: PrefixHomes) -> None:
        super().__init__(homes)
        self._shares: dict[str, float] | None = None

    def _all(self) -> dict[str, float]:
        if self._shares is None:
            self._shares = self.homes.homed_share()
        return self._shares

    def __getitem__(self, worker_id: str) -> float:
        if self._shares is None:
            return self.homes.worker_share(worker_id)
        return self._shares[worker_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


class HomedTokens(_AsOf, Mapping[str, int]):
    """`PrefixHomes.homed_tokens` per worker (of the resident prefixes, with `resident`)."""

    def __init__(self, homes: PrefixHomes, resident: bool) -> None:
        super().__init__(homes)
        self._resident = resident

    def __getitem__(self, worker_id: str) -> int:
        return self.homes.homed_tokens(worker_id, resident=self._resident)

    def __iter__(self) -> Iterator[str]:
        return iter(self.homes.token_workers())

    def __len__(self) -> int:
        return len(self.homes.token_workers())


class Residency(_AsOf):
    """Whether the cluster is `limited` (`PrefixHomes.limited`), and the prefix's residency
    and work there; `prefix_key` None: a prompt shorter than a block."""

    def __init__(self, homes: PrefixHomes, prefix_key: int | None) -> None:
        super().__init__(homes)
        self._prefix_key = prefix_key

    @property
    def limited(self) -> bool:
        return self.homes.limited()

    @property
    def resident(self) -> bool:
        return self._prefix_key is None or self.homes.resident(self._prefix_key)

    @property
    def transient(self) -> bool:
        return self._prefix_key is not None and self.homes.transient(self._prefix_key)

    def homed_work(self) -> dict[str, float]:
        return self.homes.work_shares()

    def prefix_work(self) -> float | None:
        return None if self._prefix_key is None else self.homes.work_share(self._prefix_key)


@dataclass(slots=True, unsafe_hash=True)
class PrefixPlacement:  # read-only by convention (not frozen: built per request, and a frozen dataclass is slow to build)
    """A request's prefix as the placement knows it (the defaults: nothing known)."""

    home: str | None = None  # the worker that served the prefix last
    share: float | None = None  # the prefix's share of the recent requests
    # per worker, the share of the recent requests its homed prefixes (and copies) brought
    homed_share: Mapping[str, float] = field(default_factory=dict)
    # per worker, the KV tokens its live (resident, with `resident_homes`) homed prefixes keep there
    homed_tokens: Mapping[str, int] = field(default_factory=dict)
    residency: Residency | None = None  # None: unknown (not limited, the prefix resident)

    @property
    def limited(self) -> bool:
        """Whether only some of the live prefixes can stay cached in the cluster."""
        return self.residency is not None and self.residency.limited

    @property
    def resident(self) -> bool:
        """Whether the prefix is resident: its KV is worth keeping on its home (True where unknown)."""
        return self.residency is None or self.residency.resident

    @property
    def transient(self) -> bool:
        """Whether the prefix recurs but is not resident where the cluster is `limited`: it
        misses wherever it goes."""
        return self.residency is not None and self.residency.transient

    @property
    def homed_work(self) -> Mapping[str, float]:
        """Per worker, its homed prefixes' share of the recent work, misses weighing more than
        hits (`PrefixHomes.work_shares`; empty: unknown)."""
        return self.residency.homed_work() if self.residency is not None else {}

    @property
    def prefix_work(self) -> float | None:
        """The prefix's share of the recent work (`PrefixHomes.work_share`; None: unknown)."""
        return self.residency.prefix_work() if self.residency is not None else None


def snapshot_of(homes: PrefixHomes, prefix_key: int | None, *, resident_homes: bool = True) -> PrefixPlacement:
    """`homes` on the prefix `prefix_key` as of now (None: a prompt shorter than a block);
    `resident_homes`: the homed tokens count the resident prefixes only, where not all fit."""
    return PrefixPlacement(home=homes.home(prefix_key) if prefix_key else None,
                           share=homes.share(prefix_key) if prefix_key else None,
                           homed_share=HomedShares(homes), homed_tokens=HomedTokens(homes, resident_homes),
                           residency=Residency(homes, prefix_key))
