"""The transport contract: moves whole blocks (or one layer of them), or byte ranges, between
two agents.

Implementations: `connector.nixl_transport.NixlTransport` (NIXL over UCX, DRAM or VRAM),
`connector.memory_transport.MemoryTransport` (copies between workers of one process), chosen
by `KvTransferConfig.transport`, and `connector.faults.FaultInjectingTransport`, which wraps any transport to drop, corrupt,
delay or cut transfers as configured. Failures are results, not exceptions: a transfer
always returns a `TransferResult` within its timeout.

Block transfers address blocks by id and need a peer whose blocks are this agent's size
(else a failed result). Byte-range transfers (`read_ranges` / `write_ranges`) move
`lengths[i]` bytes between `remote_offsets[i]` of the peer's pool and `local_offsets[i]` of
this one, in both directions in that argument order, and reach a peer of any geometry
(workers of unlike tensor-parallel degree or block size); their result has one `ok` flag
for the whole transfer. Ranges outside a pool are caller bugs and raise ValueError.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import msgspec
import numpy as np

Outcome = Literal["done", "failed", "cancelled"]
Offsets = Sequence[int] | np.ndarray  # byte offsets into a pool, or lengths


class TransferResult(msgspec.Struct, kw_only=True):
    outcome: Outcome
    ok: list[bool]  # per block: the bytes landed (integrity is checked by the caller); one flag for ranges
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

    async def read_ranges(self, peer: str, remote_offsets: Offsets, local_offsets: Offsets, lengths: Offsets, *,
                          timeout_s: float) -> TransferResult: ...

    async def write_ranges(self, peer: str, remote_offsets: Offsets, local_offsets: Offsets, lengths: Offsets, *,
                           timeout_s: float) -> TransferResult: ...

    def close(self) -> None: ...
