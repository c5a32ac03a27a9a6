"""KV events cut into batches that each fit one NATS message. Pure.

A worker's KV events go out as `KvEventBatch`es, one NATS message each, and a NATS server
refuses a message over its `max_payload` (1 MiB by default). A snapshot of a large cache
(every cached block, with its token ids: ~80 bytes a block) passes that at ~12k blocks, so a
worker that had to resync could never publish its snapshot. `split_events` cuts a list of
events into parts under a byte budget, in order: whole events where they fit, and an event
too large alone cut by blocks (a `BlockStored` part's parent is the previous part's last
block, so a consumer applying the parts in order sees the same chain). The publisher numbers
each part as a batch of its own (consecutive sequence numbers: no gap).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from shared.schemas.kv_events import BlockRemoved, BlocksMoved, BlockStored, KvEvent
from shared.token_pack import TOKEN_BYTES

_encoder = msgspec.msgpack.Encoder()


def encoded_size(event: KvEvent) -> int:
    return len(_encoder.encode(event))


def split_events(events: Sequence[KvEvent], max_bytes: int) -> list[list[KvEvent]]:
    """`events` in order, in parts whose events' encoded sizes sum to at most `max_bytes`
    (a lone block or hash over it still goes, alone)."""
    if max_bytes < 1:
        raise ValueError("max_bytes must be positive")
    parts: list[list[KvEvent]] = [[]]
    used = 0
    for event in events:
        for piece in _cut(event, max_bytes):
            size = encoded_size(piece)
            if parts[-1] and used + size > max_bytes:
                parts.append([])
                used = 0
            parts[-1].append(piece)
            used += size
    return [part for part in parts if part]


def _cut(event: KvEvent, max_bytes: int) -> list[KvEvent]:
    size = encoded_size(event)
    if size <= max_bytes:
        return [event]
    if isinstance(event, BlockStored):
        overhead = encoded_size(_piece(event, 0, 0, event.parent_block_hash))  # a part's fields, no block
        return _cut_stored(event, max(1, _per_part(len(event.block_hashes), size - overhead, max_bytes - overhead)))
    if isinstance(event, BlockRemoved):
        step = _per_part(len(event.block_hashes), size, max_bytes)
        return [BlockRemoved(block_hashes=event.block_hashes[start:start + step])
                for start in range(0, len(event.block_hashes), step)]
    if isinstance(event, BlocksMoved):
        step = _per_part(len(event.block_hashes), size, max_bytes)
        return [BlocksMoved(block_hashes=event.block_hashes[start:start + step], tier=event.tier)
                for start in range(0, len(event.block_hashes), step)]
    return [event]  # AllBlocksCleared: a few bytes


def _per_part(blocks: int, size: int, max_bytes: int) -> int:
    return max(1, blocks * max_bytes // size * 9 // 10)  # a tenth spare: blocks differ in size


def _cut_stored(event: BlockStored, step: int) -> list[KvEvent]:
    pieces: list[KvEvent] = []
    parent = event.parent_block_hash
    for start in range(0, len(event.block_hashes), step):
        end = min(len(event.block_hashes), start + step)
        pieces.append(_piece(event, start, end, parent))
        parent = event.block_hashes[end - 1]
    return pieces


def _piece(event: BlockStored, start: int, end: int, parent: int | None) -> BlockStored:
    """Blocks `start` to `end` of `event`, under `parent`; the cache salt (a chain's root's)
    stays with the first."""
    block_size = event.block_size
    packed_size = block_size * TOKEN_BYTES
    return BlockStored(
        block_hashes=event.block_hashes[start:end], parent_block_hash=parent,
        token_ids=event.token_ids[start * block_size:end * block_size] if event.token_ids else [],
        block_size=block_size,
        chain_hashes=event.chain_hashes[start:end] if event.chain_hashes is not None else None,
        tier=event.tier, adapter=event.adapter, cache_salt=event.cache_salt if start == 0 else "",
        packed_token_ids=event.packed_token_ids[start * packed_size:end * packed_size],
        image_salts=event.image_salts[start:end] if event.image_salts is not None else None)
