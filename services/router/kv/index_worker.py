"""One worker's part of the KV index (`index`): its tables, and the changes that touch
only them and the shared holder masks. Pure and synchronous.

- `IndexedWorker`: a worker's slot and bit in the holder masks, its engine -> Tandem map
  (`tandem_of`), extra engine hashes of the same tokens (`extra_refs`), predictions
  (`speculative`), the tier of its blocks outside the first tier (`tiers`: empty for a
  worker with one tier), its runs (`index_runs`) and its error counters;
- `drop_bit` / `release`: a block leaves a worker (the mask loses the worker's bit; the
  entry goes with the last holder);
- `apply_snapshot`: a snapshot applied as its difference from what the worker holds
  (`index_diff`): after a short gap, few of its blocks changed;
- `worker_stats`: the figures `KvIndex.stats` reports per worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from services.router.kv.index_diff import snapshot_diff
from services.router.kv.index_results import WorkerIndexStats
from services.router.kv.index_runs import Runs
from shared.cluster.sequence import SequenceTracker, SyncState
from shared.schemas.kv_events import (
    DEVICE_TIER,
    BlockStored,
    BlockStoredWithoutTokens,
    KvEvent,
    KvEventWithoutTokens,
    KvTier,
)


class IndexedWorker:
    __slots__ = ("worker_id", "slot", "bit", "block_size", "salt", "tandem_of", "extra_refs",
                 "speculative", "tiers", "rejected_blocks", "orphaned_blocks", "mismatched_blocks",
                 "unverified_blocks", "runs")

    def __init__(self, worker_id: str, slot: int, block_size: int, salt: bytes, runs: Runs) -> None:
        self.worker_id = worker_id
        self.slot = slot
        self.bit = 1 << slot
        self.block_size = block_size
        self.salt = salt
        self.tandem_of: dict[int, int] = {}
        self.extra_refs: dict[int, int] = {}
        self.speculative: dict[int, float] = {}
        self.tiers: dict[int, KvTier] = {}  # Tandem hash -> its tier, for real blocks not in the first tier
        self.rejected_blocks = 0
        self.orphaned_blocks = 0
        self.mismatched_blocks = 0  # verification: chain hashes sent that differ from the tokens'
        self.unverified_blocks = 0  # verification: chain hashes sent without token ids to check
        self.runs = runs


def drop_bit(holders: dict[int, int], block_hash: int, bit: int) -> None:
    mask = holders[block_hash]
    assert mask & bit, "index invariant: a worker's block has its bit set"
    mask ^= bit
    if mask:
        holders[block_hash] = mask
    else:
        del holders[block_hash]


def release(worker: IndexedWorker, holders: dict[int, int], block_hash: int) -> bool:
    """One engine hash of `worker` no longer maps to `block_hash`; whether the block went."""
    extra = worker.extra_refs.get(block_hash)
    if extra:
        if extra == 1:
            del worker.extra_refs[block_hash]
        else:
            worker.extra_refs[block_hash] = extra - 1
        return False
    drop_bit(holders, block_hash, worker.bit)
    return True


def apply_snapshot(worker: IndexedWorker, holders: dict[int, int],
                   events: Sequence[KvEvent | KvEventWithoutTokens]) -> int | None:
    """Apply a snapshot (`AllBlocksCleared`, then `BlockStored`s with chain hashes) as the
    difference from what the worker holds (`index_diff`). Returns the blocks it holds
    after, or None, with nothing changed, for a batch that is no such snapshot or a worker
    that holds nothing yet (applied event by event, which costs the same when every block
    is new)."""
    if not worker.tandem_of:
        return None
    runs_of_snapshot = _snapshot_runs(events, worker.block_size)
    if runs_of_snapshot is None:
        return None
    engine_runs, chain_runs, parents = runs_of_snapshot
    diff = snapshot_diff(worker.tandem_of, engine_runs, chain_runs)
    if diff is None:
        return None
    gone, added_engine, added_chain = diff
    tandem_of = worker.tandem_of
    worker.tiers = {}  # every block of the snapshot is in the first tier
    for engine_hash in gone:
        release(worker, holders, tandem_of.pop(engine_hash))
    bit = worker.bit
    speculative = worker.speculative
    extra_refs = worker.extra_refs
    runs = worker.runs
    for engine_hash, block_hash in zip(added_engine, added_chain):
        if block_hash in speculative:
            del speculative[block_hash]  # a real block supersedes the prediction; its bit stays
            runs.unspeculated(block_hash)
        else:
            mask = holders.get(block_hash)
            if mask is None:
                holders[block_hash] = bit
            elif not mask & bit:
                holders[block_hash] = mask | bit
            else:  # another engine hash of this worker, same tokens
                extra_refs[block_hash] = extra_refs.get(block_hash, 0) + 1
        tandem_of[engine_hash] = block_hash
    runs.rebuild(parents, chain_runs, tandem_of, lambda block_hash: bool(holders.get(block_hash, 0) & bit),
                 ambiguous=bool(extra_refs))
    return len(tandem_of)


def _snapshot_runs(events: Sequence[KvEvent | KvEventWithoutTokens], size: int,
                   ) -> tuple[list[list[int]], list[list[int]], list[int | None]] | None:
    """The engine hashes, chain hashes and parent engine hash of each `BlockStored` after a
    snapshot's first event, or None when one is not a device-tier store of `size` blocks with
    a full chain (the batch is then applied event by event)."""
    engine_runs: list[list[int]] = []
    chain_runs: list[list[int]] = []
    parents: list[int | None] = []
    for event in islice(events, 1, None):
        if (not isinstance(event, (BlockStored, BlockStoredWithoutTokens)) or event.block_size != size
                or event.tier != DEVICE_TIER):  # blocks of other tiers: applied event by event
            return None
        hashes = event.chain_hashes
        if hashes is None or len(hashes) != len(event.block_hashes):
            return None
        engine_runs.append(event.block_hashes)
        chain_runs.append(hashes)
        parents.append(event.parent_block_hash)
    return engine_runs, chain_runs, parents


def worker_stats(worker: IndexedWorker, sequences: SequenceTracker) -> WorkerIndexStats:
    return WorkerIndexStats(worker_id=worker.worker_id, block_size=worker.block_size,
                            blocks=len(worker.tandem_of) - sum(worker.extra_refs.values()),
                            speculative_blocks=len(worker.speculative),
                            synced=sequences.state(worker.worker_id) is not SyncState.UNSYNCED,
                            last_seq=sequences.last_seq(worker.worker_id) or 0,
                            rejected_blocks=worker.rejected_blocks,
                            orphaned_blocks=worker.orphaned_blocks,
                            mismatched_blocks=worker.mismatched_blocks,
                            unverified_blocks=worker.unverified_blocks)
