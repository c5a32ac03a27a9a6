"""The transport contract: moves whole blocks (or one layer of them) between two agents.

Implementations: `connector.nixl_transport.NixlTransport` (NIXL over UCX, DRAM or VRAM),
`connector.memory_transport.MemoryTransport` (copies between workers of one process), chosen
by `KvTransferConfig.transport`, and `connector.faults.FaultInjectingTransport`, which wraps any transport to drop, corrupt,
delay or cut transfers as configured. Failures are results, not exceptions: a transfer
always returns a `TransferResult` within its timeout.
"""

from __future__ import annotations

from typing import Literal, Protocol

import msgspec

Outcome = Literal["done", "failed", "cancelled"]


class TransferResult(msgspec.Struct, kw_only=True):
    outcome: Outcome
    ok: list[bool]  # per block: the bytes landed (integrity is checked by the caller)
    nbytes: int = 0
    duration_s: float = 0.0
    reason: str = ""

    @property
    def blocks_ok(self) -> int:
        return sum(self.ok)


class KvTransport(Protocol):
    @property
    def agent_name(self) -> str: ...

    def metadata(self) -> bytes: ...

    def add_peer(self, name: str, metadata: bytes) -> None: ...

    def remove_peer(self, name: str) -> None: ...

    def has_peer(self, name: str) -> bool: ...

    async def read(self, peer: str, remote_block_ids: list[int], local_block_ids: list[int], *,
                   timeout_s: float) -> TransferResult: ...

    async def write(self, peer: str, local_block_ids: list[int], remote_block_ids: list[int], *,
                    timeout_s: float, layer: int | None = None) -> TransferResult: ...

    def close(self) -> None: ...
