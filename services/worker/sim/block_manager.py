"""Paged KV block pool with ref counts, prefix caching and LRU eviction (pure, synchronous).

The scheduler is the only caller. A block is in exactly one of three states:
- used: referenced by at least one request (`ref_count > 0`), cached or not;
- evictable: unreferenced but cached (holds a full block's KV under its block hash);
- free: unreferenced and uncached.
Only full blocks are cached, keyed by Tandem's chain hash (`shared.block_hash`), so the hashes
in events equal the ones routers compute from token ids. Evictable blocks are reclaimed in
LRU order, and only when no free block is left.

Every change to the set of cached blocks appends a KV event to a buffer that the engine
drains with `take_events()`. Running out of blocks is an expected outcome: `allocate`
returns `None`; misuse (double free, committing twice) is a bug and asserts.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from shared.schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


@dataclass(slots=True)
class KvBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while the block is in the prefix cache
    parent_hash: int | None = None  # hash of the previous block of its sequence; None for the first
    token_ids: tuple[int, ...] = ()  # kept for snapshots (resync)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks = [KvBlock(block_id) for block_id in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._used = 0
        self._events: list[KvEvent] = []

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

    def allocate(self, count: int) -> list[int] | None:
        """`count` blocks with one reference each, or None (and no change) if too few are left."""
        if count > self.free_blocks:
            return None
        allocated: list[int] = []
        evicted: list[int] = []
        for _ in range(count):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                evicted.append(self._uncache(self._blocks[block_id]))
            block = self._blocks[block_id]
            block.ref_count = 1
            allocated.append(block_id)
        self._used += count
        if evicted:
            self._events.append(BlockRemoved(block_hashes=evicted))
        return allocated

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
                    self._free.append(block_id)

    # ---- the prefix cache ----------------------------------------------------------------

    def commit(self, block_ids: list[int], block_hashes: list[int], token_ids: list[int],
               parent_hash: int | None) -> None:
        """Cache blocks of one request that just became full, and announce them.

        `block_ids` are consecutive blocks of one sequence, `token_ids` their tokens,
        `parent_hash` the hash of the block before the first (None at the sequence start).
        A block whose hash is already cached elsewhere (two requests computed the same
        prefix at once) stays private and is not announced. Consecutive new blocks are
        announced in one `BlockStored`.
        """
        size = self.block_size
        assert len(block_ids) == len(block_hashes) and len(token_ids) == len(block_ids) * size
        stored: BlockStored | None = None
        for index, (block_id, block_hash) in enumerate(zip(block_ids, block_hashes)):
            block = self._blocks[block_id]
            assert block.ref_count > 0 and block.block_hash is None, f"block {block_id} cannot be committed"
            tokens = token_ids[index * size:(index + 1) * size]
            if block_hash in self._cached:
                stored = None
            else:
                block.block_hash = block_hash
                block.parent_hash = parent_hash
                block.token_ids = tuple(tokens)
                self._cached[block_hash] = block_id
                if stored is None:
                    stored = BlockStored(block_hashes=[], parent_block_hash=parent_hash, token_ids=[],
                                         block_size=size)
                    self._events.append(stored)
                stored.block_hashes.append(block_hash)
                stored.token_ids.extend(tokens)
            parent_hash = block_hash

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is in use."""
        if self._used:
            return False
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._uncache(self._blocks[block_id])
            self._free.append(block_id)
        assert not self._cached
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events

    def snapshot(self) -> list[BlockStored]:
        """Everything cached, as `BlockStored` events with parents before children.

        Each chain of cached blocks becomes one event; a block whose parent is not cached
        (the parent was a private duplicate) starts its own event.
        """
        children: dict[int, list[KvBlock]] = {}
        roots: list[KvBlock] = []
        for block_id in self._cached.values():
            block = self._blocks[block_id]
            if block.parent_hash is not None and block.parent_hash in self._cached:
                children.setdefault(block.parent_hash, []).append(block)
            else:
                roots.append(block)
        events: list[BlockStored] = []
        pending = list(reversed(roots))
        while pending:
            block = pending.pop()
            event = BlockStored(block_hashes=[], parent_block_hash=block.parent_hash, token_ids=[],
                                block_size=self.block_size)
            events.append(event)
            while True:
                assert block.block_hash is not None
                event.block_hashes.append(block.block_hash)
                event.token_ids.extend(block.token_ids)
                following = children.get(block.block_hash)
                if not following:
                    break
                block, *others = following
                pending.extend(reversed(others))
        return events

    def _uncache(self, block: KvBlock) -> int:
        block_hash = block.block_hash
        assert block_hash is not None
        del self._cached[block_hash]
        block.block_hash = None
        block.parent_hash = None
        block.token_ids = ()
        return block_hash
