"""What the KV index reports: per-batch `IngestResult`s and `IndexStats`. Plain data.

Produced by `KvIndex.ingest` and `KvIndex.stats` (`index`); read by the router's
KV-event adapter (`view`: a result that asks for a resync) and its metrics.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from enum import Enum

import msgspec


class IngestOutcome(str, Enum):
    APPLIED = "applied"
    GAP = "gap"  # applied, but the worker's view may be wrong until a snapshot arrives
    UNKNOWN_WORKER = "unknown_worker"  # ignored: membership has not added the worker


# One per batch on the KV event hot path: a Struct's init (C) costs a quarter of a slots
# dataclass's with these nine fields, and `gc=False` keeps it out of young collections.
class IngestResult(msgspec.Struct, gc=False):
    outcome: IngestOutcome
    synced: bool  # the worker's view is exact after this batch
    resync_needed: bool  # the worker fell out of sync with this batch: send a KvSnapshotRequest
    stored_blocks: int = 0
    removed_blocks: int = 0
    rejected_blocks: int = 0  # refused: block size differs from the worker's, or malformed
    orphaned_blocks: int = 0  # skipped: parent unknown, and no chain hashes to index them by
    mismatched_blocks: int = 0  # verification: chain hashes sent that differ from the token ids'
    moved_blocks: int = 0  # known blocks whose tier an event set (`BlocksMoved`, `BlockStored.tier`)


@dataclass(frozen=True, slots=True)
class WorkerIndexStats:
    worker_id: str
    block_size: int
    blocks: int  # distinct Tandem hashes the worker reported and still holds
    speculative_blocks: int
    synced: bool
    last_seq: int
    rejected_blocks: int  # since added; non-zero means a block-size mismatch (0% hits)
    orphaned_blocks: int
    mismatched_blocks: int = 0  # verification mode: sent chain hashes the token ids refute (a bug)
    unverified_blocks: int = 0  # verification mode: sent chain hashes without token ids to check


@dataclass(frozen=True, slots=True)
class IndexStats:
    workers: tuple[WorkerIndexStats, ...]
    total_blocks: int  # distinct Tandem hashes held by any worker

    @property
    def mismatched_blocks(self) -> int:
        return sum(worker.mismatched_blocks for worker in self.workers)

    @property
    def blocks_per_worker(self) -> dict[str, int]:
        return {worker.worker_id: worker.blocks for worker in self.workers}

    @property
    def unsynced_workers(self) -> tuple[str, ...]:
        return tuple(worker.worker_id for worker in self.workers if not worker.synced)


def object_bytes(tables: list[dict], lists: list[list]) -> int:
    """Bytes of the dicts and lists and of the objects in them, each object once."""
    seen: set[int] = set()

    def sized(objects) -> int:
        size = 0
        for obj in objects:
            if id(obj) not in seen:
                seen.add(id(obj))
                size += sys.getsizeof(obj)
        return size

    return (sum(sys.getsizeof(table) + sized(table.keys()) + sized(table.values()) for table in tables)
            + sum(sys.getsizeof(items) + sized(items) for items in lists))
