"""The blocks an engine has announced, rebuilt from its KV events. Pure: no I/O, no clock.

vLLM announces every physical block it caches, so one block hash can be stored twice
(two requests computed the same block at once) and removed twice. Routers want set
semantics. `KvBlockMirror.apply()` counts copies per hash and passes on a store only when
a hash appears (0 -> 1 copies) and a removal only when its last copy goes (1 -> 0).

The mirror is also the only state from which a worker can answer a snapshot request:
vLLM has no "list cached blocks" call, so `snapshot()` re-announces what the events said.
Token ids are kept as 4-byte arrays (a 1 GiB CPU cache of a small model holds millions).

With a host-memory tier (Tandem's connector copies every computed block there,
`connector.vllm.host_scheduler`), vLLM's event stream also says which blocks the host tier
holds (medium "CPU": `BlockStored` with tier "host", and `HostBlocksRemoved`). A block is
then in the device tier while vLLM holds a copy, else in the host tier while that holds it,
else gone, and only changes of that pass on: a block vLLM evicts while the host tier holds it
moves to "host" (`BlocksMoved`), one loaded back moves to "device", and one leaves
(`BlockRemoved`) only when neither tier holds it.

Each block is also indexed by Tandem's chain hash (`shared.block_hash`), computed from its
tokens and its parent's Tandem hash when it is stored: a holder answering a lease request
(which names Tandem hashes) finds the tokens of the longest prefix it has (`prefix_tokens`),
and the events passed on carry these hashes as `chain_hashes`, so routers need not compute
them (an event whose first block's chain is unknown, and so all of its blocks', carries None).
Blocks that hold an image's placeholder tokens carry their image salts too (`image_salts`),
so that a router hashing or verifying the chain from the token ids gets the same hashes.
"""

from __future__ import annotations

import logging
from array import array

import msgspec

from shared.block_hash import chain_root, hash_block
from shared.schemas.kv_events import (
    DEVICE_TIER,
    HOST_TIER,
    AllBlocksCleared,
    BlockRemoved,
    BlocksMoved,
    BlockStored,
    KvEvent,
    KvTier,
)

log = logging.getLogger(__name__)


class HostBlocksRemoved(msgspec.Struct, kw_only=True):
    """The host tier gave these blocks' slots to others (vLLM's `BlockRemoved`, medium "CPU")."""

    block_hashes: list[int]


class ImageBlocksStored(msgspec.Struct, kw_only=True):
    """vLLM stored blocks of a prompt with images: `salts` holds each block's images
    (`shared.block_hash.image_block_salts`, from the event's extra keys; b"" for a block
    without), which its Tandem hash takes in as the router's chain does."""

    stored: BlockStored
    salts: list[bytes]


MirrorEvent = KvEvent | HostBlocksRemoved | ImageBlocksStored


class _CachedBlock(msgspec.Struct):
    parent_hash: int | None
    token_ids: array
    copies: int  # in vLLM's own cache (the device tier)
    tandem_hash: int | None = None  # None: its parent was never announced, so the chain is unknown
    adapter: str = ""  # the LoRA adapter vLLM computed it with
    cache_salt: str = ""  # a chain's first block: the request's cache salt, which its root took in
    in_host: bool = False  # the host tier holds a copy
    image_salt: bytes = b""  # the images in it (`ImageBlocksStored.salts`), which its Tandem hash took in

    @property
    def tier(self) -> KvTier:
        return DEVICE_TIER if self.copies else HOST_TIER


class KvBlockMirror:
    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self._blocks: dict[int, _CachedBlock] = {}
        self._by_tandem: dict[int, int] = {}  # Tandem chain hash -> engine block hash
        self._device_blocks = 0  # of `_blocks`, those with a copy in vLLM's own cache
        self.malformed_events = 0  # stores whose sizes do not match the block size

    @property
    def cached_blocks(self) -> int:
        """Distinct block hashes in the engine's prefix cache, referenced or not."""
        return self._device_blocks

    @property
    def host_blocks(self) -> int:
        """Distinct block hashes the host tier holds (whether vLLM's cache does too or not)."""
        return sum(block.in_host for block in self._blocks.values())

    def apply(self, event: MirrorEvent) -> list[KvEvent]:
        """Apply one engine event; return the events to pass on (possibly none)."""
        match event:
            case BlockStored():
                return self._store(event)
            case ImageBlocksStored():
                return self._store(event.stored, event.salts)
            case BlockRemoved():
                return self._remove(event)
            case HostBlocksRemoved():
                return self._remove_from_host(event)
            case AllBlocksCleared():
                return [self.clear()]
        raise AssertionError(f"unknown KV event {event!r}")

    def clear(self) -> AllBlocksCleared:
        self._blocks.clear()
        self._by_tandem.clear()
        self._device_blocks = 0
        return AllBlocksCleared()

    def prefix_tokens(self, tandem_hashes: list[int]) -> list[int]:
        """The token ids of the longest leading run of `tandem_hashes` cached here."""
        tokens: list[int] = []
        for block_hash in self.prefix_blocks(tandem_hashes):
            tokens.extend(self._blocks[block_hash].token_ids)
        return tokens

    def prefix_blocks(self, tandem_hashes: list[int]) -> list[int]:
        """vLLM's own hashes (its events' form) of the longest leading run of `tandem_hashes`
        cached here: what a holder pins, images and adapter included."""
        found: list[int] = []
        for tandem_hash in tandem_hashes:
            block_hash = self._by_tandem.get(tandem_hash)
            if block_hash is None or not self._blocks[block_hash].copies:  # a holder pins in vLLM's cache
                break
            found.append(block_hash)
        return found

    def snapshot(self) -> list[BlockStored]:
        """Every cached block as `BlockStored` events in its tier, parents before children.

        Each chain becomes one event per run of one tier; a block whose parent is not cached
        (evicted first, or never announced because of an unrecoverable gap) starts its own event.
        """
        children: dict[int, list[int]] = {}
        roots: list[int] = []
        for block_hash, block in self._blocks.items():
            if block.parent_hash is not None and block.parent_hash in self._blocks:
                children.setdefault(block.parent_hash, []).append(block_hash)
            else:
                roots.append(block_hash)
        events: list[BlockStored] = []
        pending = list(reversed(roots))
        while pending:
            block_hash = pending.pop()
            event: BlockStored | None = None
            while True:
                block = self._blocks[block_hash]
                if event is None or event.tier != block.tier:
                    event = self._event(block.parent_hash, block, block.tier)
                    events.append(event)
                self._extend(event, block_hash, block.token_ids, block.tandem_hash, block.image_salt)
                following = children.get(block_hash)
                if not following:
                    break
                block_hash, *others = following
                pending.extend(reversed(others))
        return events

    # ---- internals -------------------------------------------------------------------

    def _event(self, parent: int | None, block: _CachedBlock, tier: KvTier) -> BlockStored:
        """An empty store event of a run that starts with `block` (under `parent`)."""
        return BlockStored(block_hashes=[], parent_block_hash=parent, token_ids=[], block_size=self.block_size,
                           chain_hashes=None if block.tandem_hash is None else [], tier=tier, adapter=block.adapter,
                           cache_salt=block.cache_salt)

    @staticmethod
    def _extend(event: BlockStored, block_hash: int, tokens: array | list[int], tandem_hash: int | None,
                image_salt: bytes) -> None:
        if image_salt and event.image_salts is None:  # the run's first block with an image
            event.image_salts = [b""] * len(event.block_hashes)
        event.block_hashes.append(block_hash)
        event.token_ids.extend(tokens)
        if event.chain_hashes is not None:
            assert tandem_hash is not None  # a run's later blocks chain from its first
            event.chain_hashes.append(tandem_hash)
        if event.image_salts is not None:
            event.image_salts.append(image_salt)

    def _store(self, event: BlockStored, salts: list[bytes] | None = None) -> list[KvEvent]:
        size = self.block_size
        if event.block_size != size or len(event.token_ids) != len(event.block_hashes) * size:
            # Partial-block hashes of hybrid models, or a block size Tandem was not told:
            # passing them on would give routers a chain they cannot recompute.
            self.malformed_events += 1
            log.warning("skipping a KV store event of %d hashes, %d tokens, block size %d "
                        "(engine block size %d)", len(event.block_hashes), len(event.token_ids),
                        event.block_size, size)
            return []
        device = event.tier == DEVICE_TIER
        stored: list[KvEvent] = []
        moved: list[int] = []  # known blocks only the host tier held: back in the device tier
        run: BlockStored | None = None  # the event collecting consecutive new blocks
        parent = event.parent_block_hash
        for index, block_hash in enumerate(event.block_hashes):
            cached = self._blocks.get(block_hash)
            if cached is not None:
                if not device:
                    cached.in_host = True
                elif cached.copies:
                    cached.copies += 1
                else:
                    cached.copies, self._device_blocks = 1, self._device_blocks + 1
                    moved.append(block_hash)
                run = None  # a known block splits the run; the next new block names it as parent
            else:
                tokens = event.token_ids[index * size:(index + 1) * size]
                salt = salts[index] if salts else b""
                cache_salt = event.cache_salt if parent is None else ""
                tandem_hash = self._tandem_hash(parent, tokens, event.adapter, cache_salt, salt)
                cached = _CachedBlock(parent, array("I", tokens), int(device), tandem_hash, event.adapter,
                                      cache_salt, in_host=not device, image_salt=salt)
                self._blocks[block_hash] = cached
                self._device_blocks += device
                if tandem_hash is not None:
                    self._by_tandem.setdefault(tandem_hash, block_hash)
                if run is None:
                    run = self._event(parent, cached, event.tier)
                    stored.append(run)
                self._extend(run, block_hash, tokens, tandem_hash, salt)
            parent = block_hash
        return ([BlocksMoved(block_hashes=moved, tier=DEVICE_TIER)] if moved else []) + stored

    def _remove(self, event: BlockRemoved) -> list[KvEvent]:
        """vLLM evicted blocks from its own cache."""
        gone: list[int] = []
        moved: list[int] = []  # the host tier still holds them
        for block_hash in event.block_hashes:
            cached = self._blocks.get(block_hash)
            if cached is None or not cached.copies:
                continue  # stored before an unrecoverable gap, or a tier we do not mirror
            cached.copies -= 1
            if cached.copies == 0:
                self._device_blocks -= 1
                if cached.in_host:
                    moved.append(block_hash)
                else:
                    self._forget(block_hash, cached)
                    gone.append(block_hash)
        return ([BlockRemoved(block_hashes=gone)] if gone else []) + \
            ([BlocksMoved(block_hashes=moved, tier=HOST_TIER)] if moved else [])

    def _remove_from_host(self, event: HostBlocksRemoved) -> list[KvEvent]:
        gone: list[int] = []
        for block_hash in event.block_hashes:
            cached = self._blocks.get(block_hash)
            if cached is None or not cached.in_host:
                continue
            cached.in_host = False
            if not cached.copies:
                self._forget(block_hash, cached)
                gone.append(block_hash)
        return [BlockRemoved(block_hashes=gone)] if gone else []

    def _forget(self, block_hash: int, cached: _CachedBlock) -> None:
        del self._blocks[block_hash]
        if cached.tandem_hash is not None and self._by_tandem.get(cached.tandem_hash) == block_hash:
            del self._by_tandem[cached.tandem_hash]

    def _tandem_hash(self, parent: int | None, tokens: list[int], adapter: str, cache_salt: str,
                     salt: bytes) -> int | None:
        if parent is None:  # the chain's root: the adapter's and salt's (vLLM's own hashes take both in)
            return hash_block(chain_root(adapter, cache_salt), tokens, salt)
        cached_parent = self._blocks.get(parent)
        if cached_parent is None or cached_parent.tandem_hash is None:
            return None
        return hash_block(cached_parent.tandem_hash, tokens, salt)
