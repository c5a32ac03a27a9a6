"""One pull's read between a holder and local ranks of any shapes: the block-I/O port
(`connector.block_io.BlockReader`) over the pull's units, written once for every engine.

The units are the holder's blocks the pull reads, by position (what `read_verified`
calls local block ids here): a read of some units plans, for every local rank and every
holder rank it takes heads and layers from (`connector.range_plan.read_sources`), the byte
ranges of those units' segments (`connector.token_map`), and moves each plan as one range
read over the local rank's transport. A unit landed when every range read touching it did.
`unit_checksum` is what the reader vouches for after a read: the digest of the unit's
per-head checksums (`connector.kv_checksums`) over the heads these local ranks hold in
every layer, computed from the pieces of local blocks the unit landed in; `expected` turns
the handle's checksums into the same digests. `scribble` makes a unit's landed bytes
garbage (fault injection: `connector.faults.FaultInjectingReader` wraps this port as it
wraps any other).

`read_units` is a pull's whole read over it, for both drivers: the sim's puller
(`connector.puller`, all of a worker's ranks in one process) and vLLM's model worker
(`connector.vllm.rank_loads`, one rank per process: it checks the heads it holds).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from connector.block_io import VerifiedRead, read_verified
from connector.faults import FaultInjectingReader, ReadFaults
from connector.kv_checksums import combine_unit_sums, complete_heads, unit_digest, unit_sums
from connector.kv_geometry import RankGeometry
from connector.kv_peer import KvPeer
from connector.range_plan import plan_ranges, read_sources
from connector.token_map import Segments
from connector.transport import TransferResult
from shared.config import KvRetryConfig


class RangeMover(Protocol):
    """What a local rank moves bytes through (a transport's range API)."""

    async def read_ranges(self, peer: str, remote_offsets: np.ndarray, local_offsets: np.ndarray,
                          lengths: np.ndarray, *, timeout_s: float) -> TransferResult: ...

    async def write_ranges(self, peer: str, remote_offsets: np.ndarray, local_offsets: np.ndarray,
                           lengths: np.ndarray, *, timeout_s: float) -> TransferResult: ...


@dataclass(frozen=True, slots=True)
class LocalRank:
    geometry: RankGeometry
    region: np.ndarray  # the rank's registered memory, flat uint8
    mover: RangeMover


async def read_units(ranks: Sequence[LocalRank], peer: KvPeer, segments: Segments, units: int, *, agent_name: str,
                     remote_block_ids: list[int], checksums: Sequence[int], faults: ReadFaults, retry: KvRetryConfig,
                     timeout_s: float) -> VerifiedRead:
    """Read a pull's `units` (the holder's `remote_block_ids`) into `ranks` through the
    `segments`, with the configured read faults injected, verify each against the holder's
    `checksums` (per unit and head) and read the failed ones again (`read_verified`)."""
    shaped = ShapedRead(ranks, peer, segments, units)
    reader = FaultInjectingReader(shaped, faults, shaped.scribble)
    return await read_verified(reader, shaped.unit_checksum, agent_name, remote_block_ids, list(range(units)),
                               shaped.expected(checksums, units), retry=retry, timeout_s=timeout_s)


class ShapedRead:
    def __init__(self, ranks: Sequence[LocalRank], peer: KvPeer, segments: Segments, num_units: int) -> None:
        self._ranks = list(ranks)
        self._peer = peer
        self._segments = segments
        self._pieces = segments.pieces(num_units)
        shape = peer.shape
        self._num_layers, self._num_heads = shape.num_layers, shape.num_kv_heads
        self.heads = complete_heads([rank.geometry for rank in self._ranks], shape.num_layers)
        if not self.heads:
            raise ValueError("the local ranks hold no head in every layer: nothing they read can be verified")

    async def read(self, peer: str, remote_block_ids: list[int], local_block_ids: list[int], *,
                   timeout_s: float) -> TransferResult:
        """Read the units `local_block_ids` (positions in the pull; `remote_block_ids` are
        their holder blocks, which the segments already name)."""
        count = len(local_block_ids)
        if not count:
            return TransferResult(outcome="done", ok=[])
        segments = self._segments.of_units(local_block_ids)
        reads = []
        for rank in self._ranks:
            for part in read_sources(rank.geometry, self._peer.shape):
                plan = plan_ranges(part, segments)
                if len(plan):
                    reads.append(rank.mover.read_ranges(self._peer.rank_agents[part.src.rank], plan.src_offsets,
                                                        plan.dst_offsets, plan.lengths, timeout_s=timeout_s))
        results = await asyncio.gather(*reads)
        failed = [result for result in results if result.outcome != "done"]
        ok = not failed
        return TransferResult(outcome="done" if ok else failed[0].outcome, ok=[ok] * count,
                              nbytes=sum(result.nbytes for result in results),
                              duration_s=max((result.duration_s for result in results), default=0.0),
                              reason=failed[0].reason if failed else "")

    def unit_checksum(self, unit: int) -> int:
        """What landed of a unit, as the digest `expected` gives for the holder's checksums."""
        pieces = [self._pieces[unit]]
        parts = [(rank.geometry, unit_sums(rank.region, rank.geometry, pieces)) for rank in self._ranks]
        return unit_digest(combine_unit_sums(parts, self._num_layers, self._num_heads, heads=self.heads)[0])

    def expected(self, checksums: Sequence[int], units: int) -> list[int]:
        """The holder's per-head checksums of `units` units (flat, unit by unit), as digests over
        the heads these ranks check."""
        table = np.asarray(checksums, dtype=np.uint64).reshape(units, self._num_heads)
        return [unit_digest(row) for row in table[:, self.heads]]

    def scribble(self, unit: int) -> None:
        """Make what a unit landed in garbage: a partly written block."""
        for rank in self._ranks:
            geometry = rank.geometry
            for block, token, count in self._pieces[unit]:
                for layer in geometry.layers:
                    for head in geometry.heads:
                        start = geometry.address(block, layer, head, 0, token)
                        rank.region[start:start + count * geometry.token_nbytes:7] ^= 0x5A
