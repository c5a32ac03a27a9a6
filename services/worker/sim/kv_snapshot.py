"""The sim's cached blocks as `BlockStored` events, parents before children (pure): what a
worker publishes when asked for a snapshot of its KV cache (`BlockManager.snapshot`).

Each chain of blocks of one tier becomes one event; a block whose parent is not announced
(evicted, or a private duplicate), or is in another tier, starts its own event.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from shared.schemas.kv_events import BlockStored, KvTier

# hash, parent, tokens, tier, adapter, cache salt
SnapshotBlock = tuple[int | None, int | None, tuple[int, ...], KvTier, str, str]


def snapshot_events(blocks: Iterable[SnapshotBlock], is_announced: Callable[[int], bool],
                    block_size: int) -> list[BlockStored]:
    children: dict[int, list[SnapshotBlock]] = {}
    roots: list[SnapshotBlock] = []
    for block in blocks:
        parent_hash = block[1]
        if parent_hash is not None and is_announced(parent_hash):
            children.setdefault(parent_hash, []).append(block)
        else:
            roots.append(block)
    events: list[BlockStored] = []
    pending: list[tuple[SnapshotBlock, BlockStored | None]] = [(root, None) for root in reversed(roots)]
    while pending:
        block, event = pending.pop()
        block_hash, parent_hash, token_ids, tier, adapter, cache_salt = block
        if event is None or event.tier != tier or event.block_hashes[-1] != parent_hash:
            event = BlockStored(block_hashes=[], parent_block_hash=parent_hash, token_ids=[],
                                block_size=block_size, chain_hashes=[], tier=tier, adapter=adapter,
                                cache_salt=cache_salt)
            events.append(event)
        assert block_hash is not None and event.chain_hashes is not None
        event.block_hashes.append(block_hash)
        event.chain_hashes.append(block_hash)
        event.token_ids.extend(token_ids)
        following = children.get(block_hash, [])
        # the first child continues this event (if of its tier); the others start their own
        pending.extend((child, None) for child in reversed(following[1:]))
        if following:
            pending.append((following[0], event))
    return events
