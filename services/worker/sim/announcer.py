"""Announcing the sim's cached blocks as `BlockStored` events, parents first (pure, synchronous).

Caller: `block_manager.BlockManager`, which owns the blocks (`KvBlock`) and the event buffer
and tells the announcer when a block enters the cache and when an unannounced one leaves it.
A block is announced only once its parent is: a router derives a block's Tandem hash from
its parent's, so a block cached behind a hole (its parent evicted, or a transferred block
whose predecessor failed) waits here, cached and reusable, until the hole is filled; then it
and the blocks that waited for it are announced, one event per chain.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.schemas.kv_events import BlockStored, KvEvent


@dataclass(slots=True)
class KvBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while the block is in the prefix cache
    parent_hash: int | None = None  # hash of the previous block of its sequence; None for the first
    token_ids: tuple[int, ...] = ()  # kept for snapshots (resync)
    announced: bool = False  # a BlockStored for it went out (its parent was announced)
    adapter: str = ""  # the LoRA adapter of its sequence (named in its BlockStored)
    cache_salt: str = ""  # a sequence's first block: its cache salt (named in its BlockStored)
    seed: int = 0  # the prefix hash before its first token: its KV bytes follow (`kv_content`)


class Announcer:
    def __init__(self, blocks: list[KvBlock], block_size: int, events: list[KvEvent]) -> None:
        """`blocks`: the block manager's blocks, by id; `events`: its buffer, appended to."""
        self._blocks = blocks
        self._block_size = block_size
        self._events = events
        self._deferred: dict[int, list[int]] = {}  # parent hash -> cached, unannounced children

    @property
    def has_deferred(self) -> bool:
        return bool(self._deferred)

    def defer(self, block: KvBlock) -> None:
        """Hold back a block that entered the cache while its parent is not announced."""
        assert block.parent_hash is not None and not block.announced
        self._deferred.setdefault(block.parent_hash, []).append(block.block_id)

    def announce(self, block: KvBlock, stored: BlockStored | None) -> BlockStored | None:
        """Announce a block that entered the cache behind an announced parent (or at its
        sequence's start) in `stored`, the event of the block before it in the same commit
        (a new event if None), then the blocks that waited for it. Returns the event the
        commit's next block may join: None once waiting blocks were announced, as later
        blocks must follow the events just appended."""
        if stored is None:
            stored = self._new_event(block.parent_hash, block.adapter, block.cache_salt)
        self._add(block, stored)
        assert block.block_hash is not None
        if block.block_hash not in self._deferred:
            return stored
        self._announce_deferred(block.block_hash)
        return None

    def forget(self, block: KvBlock) -> None:
        """An unannounced block leaves the cache: it no longer waits for its parent."""
        assert block.parent_hash is not None and not block.announced
        waiting = self._deferred[block.parent_hash]
        waiting.remove(block.block_id)
        if not waiting:
            del self._deferred[block.parent_hash]

    def _new_event(self, parent_hash: int | None, adapter: str, cache_salt: str = "") -> BlockStored:
        event = BlockStored(block_hashes=[], parent_block_hash=parent_hash, token_ids=[],
                            block_size=self._block_size, chain_hashes=[], adapter=adapter, cache_salt=cache_salt)
        self._events.append(event)
        return event

    def _add(self, block: KvBlock, event: BlockStored) -> None:
        assert block.block_hash is not None and not block.announced
        assert event.chain_hashes is not None  # the sim's events always carry chain hashes
        block.announced = True
        event.block_hashes.append(block.block_hash)
        event.chain_hashes.append(block.block_hash)
        event.token_ids.extend(block.token_ids)

    def _announce_deferred(self, parent_hash: int) -> None:
        """Announce the blocks that waited for `parent_hash`, and theirs, one event per chain."""
        pending = [(parent_hash, block_id) for block_id in reversed(self._deferred.pop(parent_hash))]
        while pending:
            parent, block_id = pending.pop()
            event = self._new_event(parent, self._blocks[block_id].adapter)
            while True:
                block = self._blocks[block_id]
                self._add(block, event)
                assert block.block_hash is not None
                waiting = self._deferred.pop(block.block_hash, None)
                if not waiting:
                    break
                block_id, *others = waiting
                pending.extend((block.block_hash, other) for other in reversed(others))
