"""Paged KV block pool with ref counts, prefix caching and LRU eviction (pure, synchronous).

Callers: the scheduler (requests' blocks) and `kv_port` (blocks pinned or received for KV
transfers). A block is in exactly one of three states:
- used: referenced (`ref_count > 0`) by requests or pins, cached or not;
- evictable: unreferenced but cached (holds a full block's KV under its block hash);
- free: unreferenced and uncached.
Only full blocks are cached, keyed by Tandem's chain hash (`shared.block_hash`), so the hashes
in events equal the ones routers compute from token ids; events carry them twice, as the
engine's hashes and as `chain_hashes` (which routers index without hashing the tokens). Evictable blocks are reclaimed in
LRU order, and only when no free block is left.

`evicted_blocks_total` counts cached blocks reclaimed to make room; `note_misses` counts
(`evicted_missed_blocks_total`) the blocks a request needed that this manager had evicted and not
cached again since: evictions that cost a recomputation (a "hot" prefix pushed out).

With a host tier (`host_blocks` > 0, `host_tier.HostTier`), an announced block evicted from
the device tier moves there (`BlocksMoved` to "host") instead of vanishing; it is removed
(`BlockRemoved`) only when the host tier drops it in its turn (LRU). `load_from_host` brings
blocks back into the device tier (`BlocksMoved` to "device"): the scheduler charges their
load time. A hash lives in one tier at a time; a host block counts as announced.

Every change to the set of announced blocks appends a KV event to a buffer that the engine
drains with `take_events()`. A block is announced (`BlockStored`) only once its parent is
announced (`announcer.Announcer`): a block cached behind a hole is reusable here at once,
but announced when the hole is filled. Running out of blocks is an expected outcome:
`allocate` returns `None`; misuse (double free, committing twice) is a bug and asserts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from services.worker.sim.announcer import Announcer, KvBlock
from services.worker.sim.host_tier import HostBlock, HostTier
from services.worker.sim.kv_snapshot import SnapshotBlock, snapshot_events
from shared.schemas.kv_events import (
    DEVICE_TIER,
    AllBlocksCleared,
    BlockRemoved,
    BlocksMoved,
    BlockStored,
    KvEvent,
)

EVICTED_MEMORY = 8  # remembered evicted hashes, per block of the pool (bounded)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, host_blocks: int = 0) -> None:
        assert num_blocks > 0 and block_size > 0 and host_blocks >= 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks = [KvBlock(block_id) for block_id in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # FIFO
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._used = 0
        self._events: list[KvEvent] = []  # the announcer appends to it too: never replaced
        self._announcer = Announcer(self._blocks, block_size, self._events)
        self.evicted_blocks_total = 0
        self.evicted_missed_blocks_total = 0
        self._evicted: OrderedDict[int, None] = OrderedDict()  # hashes evicted, oldest first
        self.host = HostTier(host_blocks) if host_blocks else None
        self.loaded_blocks_total = 0  # blocks loaded back from the host tier

    # ---- counters (also the invariants tests check) ------------------------------------

    @property
    def used_blocks(self) -> int:
        return self._used

    @property
    def cached_blocks(self) -> int:
        """Blocks in the prefix cache, referenced or not."""
        return len(self._cached)

    @property
    def evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def free_blocks(self) -> int:
        """Blocks an `allocate` call can hand out: free plus evictable."""
        return len(self._free) + len(self._evictable)

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def block_hash(self, block_id: int) -> int | None:
        return self._blocks[block_id].block_hash

    # ---- lookups and reference counting ------------------------------------------------

    def lookup(self, block_hashes: list[int]) -> list[int | None]:
        """The cached block of every hash, holes included (no references taken).

        A chain hash covers the whole prefix, so a cached block is valid KV for its position
        even when an earlier block of the chain is not cached here.
        """
        return [self._cached.get(block_hash) for block_hash in block_hashes]

    def content(self, block_id: int) -> tuple[int, tuple[int, ...]]:
        """A cached block's content seed and tokens: what its KV bytes are made of."""
        block = self._blocks[block_id]
        return block.seed, block.token_ids

    def in_host(self, block_hash: int) -> bool:
        """Whether the block is cached in the host tier (a load away from reuse)."""
        return self.host is not None and block_hash in self.host

    def match_prefix(self, block_hashes: list[int]) -> list[int]:
        """Block ids of the longest cached prefix of `block_hashes` (no references taken)."""
        matched: list[int] = []
        for block_hash in block_hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            matched.append(block_id)
        return matched

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks a request reuses."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                assert block.block_hash is not None, f"block {block_id} is neither used nor cached"
                del self._evictable[block_id]
                self._used += 1
            block.ref_count += 1

    def pin(self, block_ids: list[int]) -> None:
        """Take a reference on blocks in any state, keeping their bytes as they are.

        Unlike `touch`, a free block may be pinned too: a request that just finished released
        its private blocks, whose KV a writer may still be sending.
        """
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                if block.block_hash is None:
                    del self._free[block_id]
                else:
                    del self._evictable[block_id]
                self._used += 1
            block.ref_count += 1

    def allocate(self, count: int) -> list[int] | None:
        """`count` uncached blocks with one reference each, or None (and no change) if too few
        are left. Free blocks go first; then the least recently used evictable ones."""
        if count > self.free_blocks:
            return None
        allocated: list[int] = []
        evicted: list[int] = []
        moved: list[int] = []
        for _ in range(count):
            if self._free:
                block_id, _ = self._free.popitem(last=False)
            else:
                block_id, _ = self._evictable.popitem(last=False)
                block = self._blocks[block_id]
                self._remember_evicted(block.block_hash)
                parent_hash, token_ids, adapter, seed = block.parent_hash, block.token_ids, block.adapter, block.seed
                cache_salt = block.cache_salt
                block_hash = self._uncache(block)
                if block_hash is not None and self.host is not None:
                    moved.append(block_hash)
                    evicted += self.host.put(HostBlock(block_hash, parent_hash, token_ids, adapter, seed, cache_salt))
                elif block_hash is not None:
                    evicted.append(block_hash)
            self._blocks[block_id].ref_count = 1
            allocated.append(block_id)
        self._used += count
        if moved:
            self._events.append(BlocksMoved(block_hashes=moved, tier="host"))
        if evicted:
            self._events.append(BlockRemoved(block_hashes=evicted))
        return allocated

    def load_from_host(self, block_hashes: list[int]) -> list[int] | None:
        """Bring host-tier blocks back into the device tier, one reference each (as `touch`
        would take); their block ids, or None (and no change) if too few blocks are free."""
        assert self.host is not None and all(block_hash in self.host for block_hash in block_hashes)
        if len(block_hashes) > self.free_blocks:
            return None
        loaded = [self.host.take(block_hash) for block_hash in block_hashes]  # before evicting more there
        block_ids = self.allocate(len(loaded))
        assert block_ids is not None
        for block_id, entry in zip(block_ids, loaded):
            block = self._blocks[block_id]
            block.block_hash, block.parent_hash, block.token_ids = entry.block_hash, entry.parent_hash, entry.token_ids
            block.adapter, block.seed, block.cache_salt = entry.adapter, entry.seed, entry.cache_salt
            block.announced = True
            self._cached[entry.block_hash] = block_id
            self._evicted.pop(entry.block_hash, None)
        if block_hashes:
            self.loaded_blocks_total += len(block_hashes)
            self._events.append(BlocksMoved(block_hashes=list(block_hashes), tier=DEVICE_TIER))
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; cached blocks become evictable, others free.

        Blocks are released tail first, so that a sequence's last blocks are evicted before its
        first ones (a prefix is more likely to be shared than a suffix).
        """
        for block_id in reversed(block_ids):
            block = self._blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed more often than referenced"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._used -= 1
                if block.block_hash is not None:
                    self._evictable[block_id] = None
                else:
                    self._free[block_id] = None

    # ---- the prefix cache ----------------------------------------------------------------

    def commit(self, block_ids: list[int], block_hashes: list[int], token_ids: list[int],
               parent_hash: int | None, *, adapter: str = "", cache_salt: str = "",
               seeds: Sequence[int] = ()) -> list[bool]:
        """Cache blocks of one sequence that just became full, and announce them.

        `block_ids` are consecutive blocks of one sequence, `token_ids` their tokens,
        `parent_hash` the hash of the block before the first (None at the sequence start),
        `adapter` the sequence's LoRA adapter and `cache_salt` its salt (its chain's root;
        named in the events).
        A block whose hash is already cached elsewhere (two requests computed the same
        prefix at once) stays private and is not announced. Consecutive new blocks are
        announced in one `BlockStored`; a block whose parent is not announced waits for it.
        `seeds`: each block's content seed (kept, so a host-tier copy is written back alike).
        Returns, per block, whether it entered the cache (False: a private duplicate).
        """
        size = self.block_size
        assert len(block_ids) == len(block_hashes) and len(token_ids) == len(block_ids) * size
        cached: list[bool] = []
        stored: BlockStored | None = None
        for index, (block_id, block_hash) in enumerate(zip(block_ids, block_hashes)):
            block = self._blocks[block_id]
            assert block.ref_count > 0 and block.block_hash is None, f"block {block_id} cannot be committed"
            if block_hash in self._cached:
                stored = None
                cached.append(False)
                parent_hash = block_hash
                continue
            block.block_hash = block_hash
            self._evicted.pop(block_hash, None)
            if self.host is not None and self.host.discard(block_hash):
                # computed again while a copy waited in the host tier: the device copy replaces
                # it, announced anew after the removal (or deferred, like any block)
                self._events.append(BlockRemoved(block_hashes=[block_hash]))
                stored = None
            block.parent_hash = parent_hash
            block.adapter = adapter
            block.cache_salt = cache_salt if parent_hash is None else ""
            block.seed = seeds[index] if seeds else 0
            block.token_ids = tuple(token_ids[index * size:(index + 1) * size])
            self._cached[block_hash] = block_id
            cached.append(True)
            if parent_hash is not None and not self._is_announced(parent_hash):
                self._announcer.defer(block)
                stored = None
            else:
                stored = self._announcer.announce(block, stored)
            parent_hash = block_hash
        return cached

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is in use."""
        if self._used:
            return False
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._uncache(self._blocks[block_id])
            self._free[block_id] = None
        if self.host is not None:
            self.host.clear()
        assert not self._cached and not self._announcer.has_deferred
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KvEvent]:
        events = list(self._events)
        self._events.clear()
        return events

    def snapshot(self) -> list[BlockStored]:
        """Every announced block, as `BlockStored` events with parents before children, one
        chain of one tier per event (`kv_snapshot`)."""
        blocks: list[SnapshotBlock] = [
            (block.block_hash, block.parent_hash, block.token_ids, DEVICE_TIER, block.adapter, block.cache_salt)
            for block in map(self._blocks.__getitem__, self._cached.values()) if block.announced]
        if self.host is not None:
            blocks += [(block.block_hash, block.parent_hash, block.token_ids, "host", block.adapter, block.cache_salt)
                       for block in self.host]
        return snapshot_events(blocks, self._is_announced, self.block_size)

    def note_misses(self, block_hashes: list[int]) -> None:
        """A request needed `block_hashes` and found them uncached: count those evicted here."""
        for block_hash in block_hashes:
            if block_hash in self._evicted:
                del self._evicted[block_hash]
                self.evicted_missed_blocks_total += 1

    # ---- internals -----------------------------------------------------------------------

    def _remember_evicted(self, block_hash: int | None) -> None:
        assert block_hash is not None
        self.evicted_blocks_total += 1
        self._evicted[block_hash] = None
        self._evicted.move_to_end(block_hash)
        if len(self._evicted) > EVICTED_MEMORY * self.num_blocks:
            self._evicted.popitem(last=False)

    def _is_announced(self, block_hash: int) -> bool:
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return self.in_host(block_hash)
        return self._blocks[block_id].announced

    def _uncache(self, block: KvBlock) -> int | None:
        """Drop a block from the cache; its hash if it was announced (a `BlockRemoved` is due)."""
        block_hash = block.block_hash
        assert block_hash is not None
        del self._cached[block_hash]
        announced = block.announced
        if not announced:
            self._announcer.forget(block)
        block.block_hash = None
        block.parent_hash = None
        block.token_ids = ()
        block.announced = False
        return block_hash if announced else None
