"""KV-cache events a worker publishes as its prefix cache changes.

A batch carries a per-worker sequence number that increases by one per batch; a consumer
that sees a gap asks for a snapshot (`KvSnapshotRequest`) instead of drifting.

`block_hashes` are the engine's own hashes: consumers use them only to apply removals and
parent links. Routers compute Tandem's block-hash chain from `token_ids`
(see `shared.block_hash`).
"""

from __future__ import annotations

import msgspec

from shared.schemas.common import Message


class BlockStored(msgspec.Struct, tag="stored", kw_only=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]  # len == len(block_hashes) * block_size
    block_size: int


class BlockRemoved(msgspec.Struct, tag="removed", kw_only=True):
    block_hashes: list[int]


class AllBlocksCleared(msgspec.Struct, tag="cleared", kw_only=True):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventBatch(Message, tag="kv_batch", kw_only=True):
    worker_id: str
    seq: int
    ts: float
    events: list[KvEvent]
