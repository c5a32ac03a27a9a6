"""The holder's lease table (pure: no I/O, `now` passed in).

A lease pins blocks for one reader until it is released or expires. Every lease ends in
exactly one outcome; `take_ended()` hands the ended leases to the adapter, which unpins
their blocks in the engine. Expired leases are the safety net when a reader vanishes.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

from shared.schemas.transfer import TransferOutcome


@dataclass(slots=True)
class Lease:
    lease_id: str
    reader_worker_id: str
    block_ids: list[int]
    expires_at: float
    outcome: TransferOutcome | None = None


class LeaseTable:
    def __init__(self, holder_worker_id: str, *, max_ttl_s: float = 60.0) -> None:
        self._prefix = holder_worker_id
        self._ids = itertools.count(1)
        self.max_ttl_s = max_ttl_s
        self._active: dict[str, Lease] = {}
        self._ended: list[Lease] = []
        self.outcomes: Counter[str] = Counter()

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def pinned_blocks(self) -> int:
        return sum(len(lease.block_ids) for lease in self._active.values())

    def grant(self, reader_worker_id: str, block_ids: list[int], ttl_s: float, now: float) -> Lease:
        lease = Lease(lease_id=f"{self._prefix}-{next(self._ids)}", reader_worker_id=reader_worker_id,
                      block_ids=list(block_ids), expires_at=now + min(ttl_s, self.max_ttl_s))
        self._active[lease.lease_id] = lease
        return lease

    def extend(self, lease_id: str, ttl_s: float, now: float) -> bool:
        lease = self._active.get(lease_id)
        if lease is None:
            return False
        lease.expires_at = max(lease.expires_at, now + min(ttl_s, self.max_ttl_s))
        return True

    def release(self, lease_id: str, outcome: TransferOutcome) -> Lease | None:
        """End a lease with the reader's outcome; None if it already ended (e.g. expired)."""
        lease = self._active.pop(lease_id, None)
        if lease is not None:
            self._end(lease, outcome)
        return lease

    def expire(self, now: float) -> list[Lease]:
        expired = [lease for lease in self._active.values() if lease.expires_at <= now]
        for lease in expired:
            del self._active[lease.lease_id]
            self._end(lease, "expired")
        return expired

    def cancel_all(self) -> list[Lease]:
        leases = list(self._active.values())
        self._active.clear()
        for lease in leases:
            self._end(lease, "cancelled")
        return leases

    def take_ended(self) -> list[Lease]:
        ended, self._ended = self._ended, []
        return ended

    def _end(self, lease: Lease, outcome: TransferOutcome) -> None:
        lease.outcome = outcome
        self.outcomes[outcome] += 1
        self._ended.append(lease)
