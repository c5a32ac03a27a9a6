"""KV-cache events a worker publishes as its prefix cache changes.

A batch carries a per-worker sequence number that increases by one per batch; a consumer
that sees a gap asks for a snapshot (`KvSnapshotRequest`) instead of drifting. A snapshot
is one batch: `AllBlocksCleared`, then every cached block as `BlockStored` events.

`block_hashes` are the engine's own hashes: consumers use them only to apply removals and
parent links. `chain_hashes` are Tandem's block-hash chain of the same blocks
(`shared.block_hash`), computed by the worker: routers index them as they are. A
publisher that cannot compute them (a block whose parent's chain is unknown) leaves them
`None`, and routers compute the chain from `token_ids` (and `image_salts`, where blocks hold
images' placeholder tokens). Routers in verification mode
recompute every chain from `token_ids` and count the blocks whose hash differs, so
publishers send `token_ids` too; an event with `chain_hashes` may leave them empty.

Token ids on the wire. Producers fill `BlockStored.token_ids`; a publisher sends them packed
(`for_wire`: `packed_token_ids`, 4 bytes each, little-endian, `shared.token_pack`), one
msgpack `bin` that a consumer not reading them steps over at once, where an array of ints
costs a step per token (16 per block, where the hashes are 2). Consumers read either form
(`packed_token_ids_of`): workers from before packing send `token_ids`, and a consumer from
before reads packed events as sent without token ids (their chain hashes are what it indexes).

A consumer that does not read the token ids decodes a batch as `KvEventBatchWithoutTokens`:
the same tags and fields but the token ids, which msgspec skips (a struct ignores fields it
does not declare). Its events read as ones sent without token ids.

Not tracked by the garbage collector (`gc=False`): a router decodes a batch per message, and
tracking each one made its young-generation collections a tenth of decode plus ingest. They
hold lists of ints and strings, never themselves: no reference cycle can run through one.

Tiers. A worker may keep blocks in more than one place: the engine's own KV memory
(`"device"`, the first tier), then host memory and disk, where a hit costs a load instead of
a recomputation. `BlockStored.tier` says where stored blocks are; `BlocksMoved` says that
blocks the worker announced moved to another tier (evicted from the first tier to host
memory, or loaded back). A block is removed (`BlockRemoved`) only when it leaves every
tier. Events without a tier (older workers, engines with one tier) mean the first tier.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar, Literal

import msgspec

from shared.schemas.common import Message
from shared.token_pack import pack_token_ids, unpack_token_ids

KvTier = Literal["device", "host", "disk"]  # fastest first
DEVICE_TIER: KvTier = "device"
HOST_TIER: KvTier = "host"


class BlockStored(msgspec.Struct, tag="stored", kw_only=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int] = []  # len == len(block_hashes) * block_size, or empty with chain_hashes
    block_size: int
    chain_hashes: list[int] | None = None  # Tandem's chain, one per block (len == len(block_hashes))
    tier: KvTier = DEVICE_TIER  # where the blocks are
    # the LoRA adapter whose KV these blocks are ("": the base model's, or not said): the
    # chain of a block without a parent starts from `shared.block_hash.adapter_root(adapter)`
    adapter: str = ""
    # vLLM's cache salt of a chain these blocks start ("": none): with the adapter, the root
    # is `shared.block_hash.chain_root(adapter, cache_salt)`
    cache_salt: str = ""
    packed_token_ids: bytes = b""  # the token ids as sent (`for_wire`): `token_ids` is then empty
    # blocks of a prompt with images: each block's images (`shared.block_hash.image_block_salts`,
    # b"" for a block without), which its chain hash takes in; None: no block holds an image
    image_salts: list[bytes] | None = None


class BlocksMoved(msgspec.Struct, tag="moved", kw_only=True, gc=False):
    """Announced blocks (engine hashes) now live in `tier`: still cached, at another cost."""

    block_hashes: list[int]
    tier: KvTier


class BlockRemoved(msgspec.Struct, tag="removed", kw_only=True, gc=False):
    block_hashes: list[int]


class AllBlocksCleared(msgspec.Struct, tag="cleared", kw_only=True, gc=False):
    pass


KvEvent = BlockStored | BlockRemoved | BlocksMoved | AllBlocksCleared


class _KvBatchHead(Message, kw_only=True, gc=False):
    """A `kv_batch` but its events: one declaration for both ways of decoding it."""

    worker_id: str
    seq: int
    ts: float


class KvEventBatch(_KvBatchHead, tag="kv_batch", kw_only=True, gc=False):
    events: list[KvEvent]


class BlockStoredWithoutTokens(msgspec.Struct, tag="stored", kw_only=True, gc=False):
    """A `BlockStored` decoded without its token ids (skipped on the wire, not validated)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    block_size: int
    chain_hashes: list[int] | None = None
    tier: KvTier = DEVICE_TIER
    adapter: str = ""
    cache_salt: str = ""
    token_ids: ClassVar[tuple[int, ...]] = ()  # not decoded: read as an event sent without them
    packed_token_ids: ClassVar[bytes] = b""
    image_salts: ClassVar[None] = None  # read only with the token ids


KvEventWithoutTokens = BlockStoredWithoutTokens | BlockRemoved | BlocksMoved | AllBlocksCleared


class KvEventBatchWithoutTokens(_KvBatchHead, tag="kv_batch", kw_only=True, gc=False):
    """A `KvEventBatch` decoded without its events' token ids."""

    events: list[KvEventWithoutTokens]


def for_wire(events: Iterable[KvEvent]) -> list[KvEvent]:
    """`events` as a publisher sends them: each `BlockStored`'s token ids packed."""
    return [msgspec.structs.replace(event, token_ids=[], packed_token_ids=pack_token_ids(event.token_ids))
            if type(event) is BlockStored and event.token_ids else event for event in events]


def packed_token_ids_of(event: BlockStored | BlockStoredWithoutTokens) -> bytes:
    """The event's token ids packed (`shared.token_pack`), in whichever form it came."""
    return event.packed_token_ids or pack_token_ids(event.token_ids)


def token_ids_of(event: BlockStored) -> list[int]:
    """The event's token ids, in whichever form it came (a consumer reading them one by one)."""
    return list(event.token_ids) or unpack_token_ids(event.packed_token_ids)
