"""A worker's blocks leaving the KV index (`index`), or its first tier: the `BlockRemoved`,
`BlocksMoved` and `AllBlocksCleared` events of a batch. Pure and synchronous.

Caller: `KvIndex.ingest`, once per such event of a batch that is not applied as a snapshot's
difference (`KvIndex.remove_worker` clears a worker's real blocks too). The `BlockStored`s
of the same batch go to `index_store`; the counts returned here feed `IngestResult`.
"""

from __future__ import annotations

from services.router.kv.index_worker import IndexedWorker, drop_bit, release
from shared.schemas.kv_events import DEVICE_TIER, KvTier


def move_blocks(worker: IndexedWorker, engine_hashes: list[int], tier: KvTier) -> int:
    """The worker's blocks `engine_hashes` are now in `tier`; how many the index knows."""
    tandem_of = worker.tandem_of
    tiers = worker.tiers
    moved = 0
    for engine_hash in engine_hashes:
        block_hash = tandem_of.get(engine_hash)
        if block_hash is None:
            continue  # never indexed, or removed since
        if tier == DEVICE_TIER:
            tiers.pop(block_hash, None)
        else:
            tiers[block_hash] = tier
        moved += 1
    return moved


def remove_blocks(worker: IndexedWorker, holders: dict[int, int], engine_hashes: list[int]) -> int:
    """The worker dropped its blocks `engine_hashes`; how many the index knew."""
    tandem_of = worker.tandem_of
    removed = 0
    dropped: list[int] = []
    for engine_hash in engine_hashes:
        block_hash = tandem_of.pop(engine_hash, None)
        if block_hash is None:
            continue  # never indexed (an orphan) or already removed: removal is idempotent
        if release(worker, holders, block_hash):
            dropped.append(block_hash)
            if worker.tiers:
                worker.tiers.pop(block_hash, None)
        removed += 1
    if dropped:
        worker.runs.dropped_real(dropped)
    return removed


def clear_real(worker: IndexedWorker, holders: dict[int, int]) -> None:
    """Drop every block the worker reported; its speculative blocks stay (requests in flight)."""
    block_hashes = worker.tandem_of.values()
    for block_hash in set(block_hashes) if worker.extra_refs else block_hashes:
        drop_bit(holders, block_hash, worker.bit)
    worker.tandem_of = {}
    worker.extra_refs = {}
    worker.tiers = {}
    worker.runs.reset(worker.speculative.__contains__)
