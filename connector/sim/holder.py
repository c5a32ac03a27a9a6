"""Leases on the blocks of an engine with an in-process `KvPort` (the sim engine): pinning
and unpinning are synchronous calls on the port. The protocol itself (NATS request/reply,
lease lifetimes, expiry sweep) is `connector.holder.LeaseHolder`'s. Built by
`connector.sim.worker_kv.WorkerKv`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from connector.holder import LeaseHolder
from connector.leases import Lease
from connector.port import KvPort
from connector.rank_transports import RankTransports
from shared.bus import Bus
from shared.codec import MalformedCounter
from shared.schemas.transfer import KvHandle
from shared.subjects import Subjects


class KvHolder(LeaseHolder):
    """Leases on the sim engine's blocks: pinning is a synchronous call on its `KvPort`."""

    def __init__(self, worker_id: str, bus: Bus, subjects: Subjects, port: KvPort, agents: RankTransports, *,
                 compat_hash: str, block_size: int, lease_ttl_s: float, sweep_interval_s: float = 0.1,
                 malformed: MalformedCounter | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(worker_id, bus, subjects, compat_hash=compat_hash, block_size=block_size,
                         lease_ttl_s=lease_ttl_s, sweep_interval_s=sweep_interval_s, malformed=malformed,
                         clock=clock)
        self._port = port
        self._agents = agents

    def grant(self, reader_worker_id: str, block_hashes: list[int], ttl_s: float | None = None) -> KvHandle | None:
        """Pin the longest cached prefix of `block_hashes` under a new lease; None if nothing is cached."""
        block_ids = self._port.pin_prefix(block_hashes)
        if not block_ids:
            return None
        return self._lease(reader_worker_id, block_ids, block_hashes, self._port.block_checksums(block_ids),
                           self.lease_ttl_s if ttl_s is None else ttl_s)

    async def grant_prefix(self, reader_worker_id: str, block_hashes: list[int], ttl_s: float) -> KvHandle | None:
        return self.grant(reader_worker_id, block_hashes, ttl_s)

    def _unpin(self, ended: list[Lease]) -> None:
        for lease in ended:
            self._port.unpin(lease.block_ids)

    @property
    def agent_name(self) -> str:
        return self._agents.agent_name

    def agent_metadata(self) -> bytes:
        return self._agents.metadata()
