"""KV index: which Tandem block hashes each worker holds. Pure and synchronous.

Callers: the router's KV-event adapter feeds `ingest(KvEventBatch)` and sends the
`KvSnapshotRequest` an `IngestResult` (`index_results`) asks for; membership calls
`add_worker` / `remove_worker`; the routing policy asks `match(block_hashes)` on the
request hot path (and `held_prefix` for the part a worker could lend) and records its
decision with `add_speculative(..., expires_at)`; each routing calls `expire(now)`.
No I/O, no clock: time is always passed in.

Hashes. The index is keyed by Tandem's chain (`shared.block_hash`), so that the router and
every worker with the same block size and salt agree whatever engine runs. Workers compute
it and send it (`BlockStored.chain_hashes`): those are indexed as they are, and a block whose
parent is unknown is indexed all the same (its hash covers its prefix). An event without
them is hashed from its `token_ids`, from the parent's Tandem hash (`index_store`). With
`verify_hashes`, every chain is computed there; the sent one is only compared, and the
blocks where the two differ are counted (`mismatched_blocks`: a worker's bug). Engine hashes
only link a stored event to its parent and name the blocks a `BlockRemoved` drops: each
worker keeps engine -> Tandem.

Tiers. A block a worker holds in a slower tier (host memory, disk: `BlockStored.tier`,
`BlocksMoved`) is still held: `match` counts it like any other, and `tiers(worker_id)`
says which of the worker's blocks are not in the first tier (the cost model charges their
load). Only those are kept (`IndexedWorker.tiers`), so a worker with one tier costs nothing more.

Layout (why `match` looks up few of the request's blocks):
- `_holders: dict[tandem hash, int]`: a bitmask of the worker slots holding the block,
  really or speculatively. Worker ids are interned to small slots (lowest free first) so
  masks stay as short as the fleet; a block with one holder stores that worker's own
  `bit` object, so it costs no int of its own.
- per worker (`index_worker.IndexedWorker`): `tandem_of` (engine hash -> Tandem hash:
  removals, parents, purge), `speculative` (Tandem hash -> expires_at) and `extra_refs`
  (Tandem hash -> how many more engine hashes of this worker map to it; empty unless the
  engine hashes keys that Tandem does not, e.g. LoRA or multimodal extras), and `runs`
  (`index_runs`): whether each block it holds has its parent held too, so that its bit
  is monotone along a chain.
With `trust_chains` (the router's setting: each hash covers its prefix, as workers compute
them), `match` bisects the chain when every worker holding its first block is closed so;
else, and without it, it scans the chain (`index_match`). Trusting differs only for a
worker that sends a wrong hash mid-chain: the scan stops there, bisection may not.
Invariant: bit w is set in `_holders[t]` iff t is one of worker w's real blocks (a value
of `tandem_of`) or one of its speculative blocks; the two sets are disjoint.
Memory: ~160-170 bytes per indexed (worker, block), measured by `tandem bench index`
(`bytes_per_block`, 1M blocks over 16-1024 workers; the runs take ~15 of them).

Sequence numbers (`shared.cluster.sequence`): a batch out of order (a lost batch, a
restarted worker) or a `BlockStored` whose parent the index does not know is a gap. The
batch is still applied (the best view there is), the worker is unsynced, and
`IngestResult.resync_needed` asks once for a snapshot (the adapter retries on its own timer
while `unsynced_workers()` lists the worker). A batch with `AllBlocksCleared` resyncs: what
follows the clear is the worker's whole state, in which an unknown parent is no gap (its
parent was evicted); blocks that cannot be hashed without it are skipped and counted as
orphaned. A snapshot (a batch that opens with the clear) whose events all carry chain
hashes is applied as a difference (`index_worker.apply_snapshot`, `index_diff`): only the blocks that changed
are touched, so resyncing a worker of 1M blocks costs a few sorts of u64 arrays, not 2M dict
updates in Python. A block announced again under an engine hash the worker already
reported is skipped (vLLM re-announces hits).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from itertools import count

from services.router.kv.index_match import drop_points, linear_drop_points, overlaps_of
from services.router.kv.index_remove import clear_real, move_blocks, remove_blocks
from services.router.kv.index_results import IndexStats, IngestOutcome, IngestResult, object_bytes
from services.router.kv.index_runs import OpenMask, Runs
from services.router.kv.index_store import store_event
from services.router.kv.index_worker import IndexedWorker, apply_snapshot, drop_bit, worker_stats
from shared.block_hash import ROOT_PARENT, block_hash_chain
from shared.cluster.sequence import SequenceTracker
from shared.schemas.kv_events import (
    DEVICE_TIER,
    AllBlocksCleared,
    BlockRemoved,
    BlocksMoved,
    BlockStored,
    BlockStoredWithoutTokens,
    KvEventBatch,
    KvEventBatchWithoutTokens,
    KvTier,
)

_STORED = (BlockStored, BlockStoredWithoutTokens)


def block_hashes_for(token_ids: Sequence[int], block_size: int, salt: bytes = b"", *,
                     parent_hash: int = ROOT_PARENT) -> list[int]:
    """Tandem's chain for every full block of `token_ids` (a request's, or an event's)."""
    return block_hash_chain(token_ids, block_size, parent_hash=parent_hash, salt=salt)


class KvIndex:
    def __init__(self, *, verify_hashes: bool = False, trust_chains: bool = False) -> None:
        self.verify_hashes = verify_hashes
        self.trust_chains = trust_chains
        self._holders: dict[int, int] = {}
        self._workers: dict[str, IndexedWorker] = {}
        self._by_slot: list[IndexedWorker | None] = []
        self._free_slots: list[int] = []  # a heap: reuse the lowest slot to keep masks short
        self._configs: dict[tuple[int, bytes], int] = {}  # (block_size, salt) -> workers
        self._expiry: list[tuple[float, int, IndexedWorker, list[int]]] = []  # a heap
        self._expiry_order = count()
        self._sequences = SequenceTracker()
        self._open = OpenMask()  # workers whose blocks are not closed under "parent of" (`index_runs`)

    # ---- membership ---------------------------------------------------------------------

    def add_worker(self, worker_id: str, block_size: int, salt: bytes = b"") -> None:
        """Start indexing a worker; a no-op if it is known with the same block size and salt."""
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        known = self._workers.get(worker_id)
        if known is not None:
            if (known.block_size, known.salt) == (block_size, salt):
                return
            self.remove_worker(worker_id)  # hashes under the old config mean nothing now
        slot = heapq.heappop(self._free_slots) if self._free_slots else len(self._by_slot)
        worker = IndexedWorker(worker_id, slot, block_size, salt, Runs(self.trust_chains, 1 << slot, self._open))
        if slot == len(self._by_slot):
            self._by_slot.append(worker)
        else:
            self._by_slot[slot] = worker
        self._workers[worker_id] = worker
        config = (block_size, salt)
        self._configs[config] = self._configs.get(config, 0) + 1

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and everything it held, real or speculative."""
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return
        self._sequences.forget(worker_id)
        clear_real(worker, self._holders)
        for block_hash in worker.speculative:
            drop_bit(self._holders, block_hash, worker.bit)
        worker.speculative = {}
        self._by_slot[worker.slot] = None
        self._open.mask &= ~worker.bit
        heapq.heappush(self._free_slots, worker.slot)
        config = (worker.block_size, worker.salt)
        self._configs[config] -= 1
        if not self._configs[config]:
            del self._configs[config]

    # ---- events -------------------------------------------------------------------------

    def ingest(self, batch: KvEventBatch | KvEventBatchWithoutTokens) -> IngestResult:
        """Apply a worker's batch (decoded without token ids where the index does not read them:
        `batch_decode`): its stores by `index_store`, its removals, moves and clears by `index_remove`."""
        worker = self._workers.get(batch.worker_id)
        if worker is None:
            return IngestResult(IngestOutcome.UNKNOWN_WORKER, synced=False, resync_needed=False)
        events = batch.events
        if events and type(events[0]) is AllBlocksCleared and not self.verify_hashes:
            replaced = apply_snapshot(worker, self._holders, events)
            if replaced is not None:  # a snapshot, applied as its difference from the worker's view
                step = self._sequences.observe(batch.worker_id, batch.seq, resynced=True)
                return IngestResult(IngestOutcome.APPLIED, synced=step.synced, resync_needed=step.resync_needed,
                                    stored_blocks=replaced)
        stored = removed = rejected = orphaned = mismatched = moved = 0
        cleared = lost = False  # lost: a block's parent is unknown, and no clear came first
        for event in events:
            if isinstance(event, _STORED):
                event_stored, event_rejected, event_orphaned, unlinked, event_mismatched = store_event(
                    worker, self._holders, event, self.verify_hashes)
                stored += event_stored
                rejected += event_rejected
                orphaned += event_orphaned
                mismatched += event_mismatched
                lost = lost or (unlinked and not cleared)
                if event.tier != DEVICE_TIER or worker.tiers:
                    moved += move_blocks(worker, event.block_hashes, event.tier)
            elif type(event) is BlockRemoved:
                removed += remove_blocks(worker, self._holders, event.block_hashes)
            elif type(event) is BlocksMoved:
                moved += move_blocks(worker, event.block_hashes, event.tier)
            else:
                assert type(event) is AllBlocksCleared, f"unknown KV event {event!r}"
                clear_real(worker, self._holders)
                cleared = True
        step = self._sequences.observe(batch.worker_id, batch.seq, resynced=cleared, lost=lost)
        gap = not step.synced and (step.out_of_order or lost)
        outcome = IngestOutcome.GAP if gap else IngestOutcome.APPLIED
        return IngestResult(outcome, synced=step.synced, resync_needed=step.resync_needed,
                            stored_blocks=stored, removed_blocks=removed, rejected_blocks=rejected,
                            orphaned_blocks=orphaned, mismatched_blocks=mismatched, moved_blocks=moved)

    # ---- speculation --------------------------------------------------------------------

    def add_speculative(self, worker_id: str, block_hashes: Sequence[int], expires_at: float) -> int:
        """Predict that `worker_id` will hold `block_hashes` (a request was just routed there:
        its chain, from the first block; `index_runs` takes that block for a root).

        Until `expires_at`, `match` counts them, so sibling requests that arrive before the
        worker's events follow the first one. A real `BlockStored` supersedes a prediction;
        a later prediction extends it. Returns how many blocks became speculative.
        """
        worker = self._workers.get(worker_id)
        if worker is None:
            return 0
        holders = self._holders
        bit = worker.bit
        speculative = worker.speculative
        touched: list[int] = []
        added_at: list[int] = []
        for position, block_hash in enumerate(block_hashes):
            mask = holders.get(block_hash, 0)
            if mask & bit:
                previous = speculative.get(block_hash)
                if previous is not None and previous < expires_at:  # None: really held
                    speculative[block_hash] = expires_at
                    touched.append(block_hash)
                continue
            holders[block_hash] = mask | bit if mask else bit
            speculative[block_hash] = expires_at
            touched.append(block_hash)
            added_at.append(position)
        if touched:
            heapq.heappush(self._expiry, (expires_at, next(self._expiry_order), worker, touched))
        worker.runs.speculated(block_hashes, added_at)
        return len(added_at)

    def expire(self, now: float) -> int:
        """Drop speculative blocks whose time has come; returns how many."""
        expired = 0
        dropped: dict[IndexedWorker, list[int]] = {}
        while self._expiry and self._expiry[0][0] <= now:
            _, _, worker, block_hashes = heapq.heappop(self._expiry)
            if self._workers.get(worker.worker_id) is not worker:
                continue  # removed since (or removed and added again)
            speculative = worker.speculative
            for block_hash in block_hashes:
                expires_at = speculative.get(block_hash)
                if expires_at is None or expires_at > now:
                    continue  # became real, or a later prediction extended it
                del speculative[block_hash]
                drop_bit(self._holders, block_hash, worker.bit)
                dropped.setdefault(worker, []).append(block_hash)
                expired += 1
        for worker, block_hashes in dropped.items():  # once all are gone: a parent may go with its child
            worker.runs.dropped_speculative(block_hashes)
        return expired

    # ---- queries ------------------------------------------------------------------------

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Per worker, how many leading blocks of the chain it holds (only workers with >= 1).

        With `trust_chains`, if every worker holding the first block is closed
        (`index_runs`), by bisection: O(log n) lookups per point where some drop out;
        otherwise the linear scan (`index_match`)."""
        if not block_hashes:
            return {}
        get = self._holders.get
        first = get(block_hashes[0], 0)
        if not first:
            return {}
        if self.trust_chains and not first & self._open.mask:
            return overlaps_of(drop_points(get, block_hashes, first), self._by_slot)
        return overlaps_of(linear_drop_points(get, block_hashes), self._by_slot)

    def _match_linear(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """`match` by the linear scan, whatever the workers (for tests)."""
        return overlaps_of(linear_drop_points(self._holders.get, block_hashes), self._by_slot)

    def held_prefix(self, worker_id: str, block_hashes: Sequence[int], overlap: int) -> int:
        """Of the first `overlap` blocks of the chain (as `match` found for `worker_id`), how
        many lead the chain without a speculative one: what the worker reported holding,
        and so could lend to another worker right now."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return 0
        speculative = worker.speculative
        if not speculative:
            return overlap
        for position in range(overlap):
            if block_hashes[position] in speculative:
                return position
        return overlap

    def tiers(self, worker_id: str) -> Mapping[int, KvTier]:
        """The worker's real blocks outside the first tier: Tandem hash -> tier (empty for a
        worker whose blocks are all in its first tier, or an unknown worker)."""
        worker = self._workers.get(worker_id)
        return worker.tiers if worker is not None else {}

    def holds(self, worker_id: str, block_hash: int) -> bool:
        """Whether the worker holds (or is predicted to hold) the block."""
        worker = self._workers.get(worker_id)
        return worker is not None and bool(self._holders.get(block_hash, 0) & worker.bit)

    def match_tokens(self, token_ids: Sequence[int]) -> dict[str, int]:
        """`match` over every (block size, salt) the workers use: one chain per config."""
        overlaps: dict[str, int] = {}
        for block_size, salt in self._configs:
            overlaps.update(self.match(block_hashes_for(token_ids, block_size, salt)))
        return overlaps

    def memory_bytes(self) -> int:
        """Bytes of the index's tables and the ints in them, each object once. O(blocks):
        for benchmarks and debugging, not for a metrics loop."""
        tables: list[dict] = [self._holders]
        runs: list[list] = []
        for worker in self._workers.values():
            tables += [worker.tandem_of, worker.extra_refs, worker.speculative, worker.tiers, worker.runs.tails, worker.runs.kids,
                       worker.runs.spec_parent]
            runs += worker.runs.tails.values()
        return object_bytes(tables, runs)

    def workers(self) -> list[str]:
        return list(self._workers)

    def open_workers(self) -> list[str]:
        """Workers whose chains `match` scans linearly (`index_runs`: not closed)."""
        return [worker.worker_id for worker in self._workers.values() if not worker.runs.closed]

    def unsynced_workers(self) -> list[str]:
        return self._sequences.unsynced()

    def stats(self) -> IndexStats:
        workers = tuple(worker_stats(worker, self._sequences) for worker in self._workers.values())
        return IndexStats(workers=workers, total_blocks=len(self._holders))
