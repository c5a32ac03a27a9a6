"""The blocks an engine has announced, rebuilt from its KV events. Pure: no I/O, no clock.

vLLM announces every physical block it caches, so one block hash can be stored twice
(two requests computed the same block at once) and removed twice. Routers want set
semantics. `KvBlockMirror.apply()` counts copies per hash and passes on a store only when
a hash appears (0 -> 1 copies) and a removal only when its last copy goes (1 -> 0).

The mirror is also the only state from which a worker can answer a snapshot request:
vLLM has no "list cached blocks" call, so `snapshot()` re-announces what the events said.
Token ids are kept as 4-byte arrays (a 1 GiB CPU cache of a small model holds millions).

Each block is also indexed by Tandem's chain hash (`shared.block_hash`), computed from its
tokens and its parent's Tandem hash when it is stored: a holder answering a lease request
(which names Tandem hashes) finds the tokens of the longest prefix it has (`prefix_tokens`),
and the events passed on carry these hashes as `chain_hashes`, so routers need not compute
them (an event whose first block's chain is unknown, and so all of its blocks', carries None).
"""

from __future__ import annotations

import logging
from array import array

import msgspec

from shared.block_hash import adapter_root, hash_block
from shared.schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

log = logging.getLogger(__name__)


class _CachedBlock(msgspec.Struct):
    parent_hash: int | None
    token_ids: array
    copies: int
    tandem_hash: int | None = None  # None: its parent was never announced, so the chain is unknown
    adapter: str = ""  # the LoRA adapter vLLM computed it with


class KvBlockMirror:
    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self._blocks: dict[int, _CachedBlock] = {}
        self._by_tandem: dict[int, int] = {}  # Tandem chain hash -> engine block hash
        self.malformed_events = 0  # stores whose sizes do not match the block size

    @property
    def cached_blocks(self) -> int:
        """Distinct block hashes in the engine's prefix cache, referenced or not."""
        return len(self._blocks)

    def apply(self, event: KvEvent) -> list[KvEvent]:
        """Apply one engine event; return the events to pass on (possibly none)."""
        match event:
            case BlockStored():
                return self._store(event)
            case BlockRemoved():
                return self._remove(event)
            case AllBlocksCleared():
                return [self.clear()]
        raise AssertionError(f"unknown KV event {event!r}")

    def clear(self) -> AllBlocksCleared:
        self._blocks.clear()
        self._by_tandem.clear()
        return AllBlocksCleared()

    def prefix_tokens(self, tandem_hashes: list[int]) -> list[int]:
        """The token ids of the longest leading run of `tandem_hashes` cached here."""
        tokens: list[int] = []
        for tandem_hash in tandem_hashes:
            block_hash = self._by_tandem.get(tandem_hash)
            if block_hash is None:
                break
            tokens.extend(self._blocks[block_hash].token_ids)
        return tokens

    def snapshot(self) -> list[BlockStored]:
        """Every cached block as `BlockStored` events, parents before children.

        Each chain becomes one event; a block whose parent is not cached (evicted first,
        or never announced because of an unrecoverable gap) starts its own event.
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
            root = self._blocks[block_hash]
            event = BlockStored(block_hashes=[], parent_block_hash=root.parent_hash, token_ids=[],
                                block_size=self.block_size, chain_hashes=None if root.tandem_hash is None else [],
                                adapter=root.adapter)
            events.append(event)
            while True:
                block = self._blocks[block_hash]
                event.block_hashes.append(block_hash)
                event.token_ids.extend(block.token_ids)
                if event.chain_hashes is not None:
                    assert block.tandem_hash is not None  # a child of a known chain is known
                    event.chain_hashes.append(block.tandem_hash)
                following = children.get(block_hash)
                if not following:
                    break
                block_hash, *others = following
                pending.extend(reversed(others))
        return events

    # ---- internals -------------------------------------------------------------------

    def _store(self, event: BlockStored) -> list[KvEvent]:
        size = self.block_size
        if event.block_size != size or len(event.token_ids) != len(event.block_hashes) * size:
            # Partial-block hashes of hybrid models, or a block size Tandem was not told:
            # passing them on would give routers a chain they cannot recompute.
            self.malformed_events += 1
            log.warning("skipping a KV store event of %d hashes, %d tokens, block size %d "
                        "(engine block size %d)", len(event.block_hashes), len(event.token_ids),
                        event.block_size, size)
            return []
        passed: list[KvEvent] = []
        run: BlockStored | None = None  # the event collecting consecutive new blocks
        parent = event.parent_block_hash
        for index, block_hash in enumerate(event.block_hashes):
            cached = self._blocks.get(block_hash)
            if cached is not None:
                cached.copies += 1
                run = None  # a known block splits the run; the next new block names it as parent
            else:
                tokens = event.token_ids[index * size:(index + 1) * size]
                tandem_hash = self._tandem_hash(parent, tokens, event.adapter)
                self._blocks[block_hash] = _CachedBlock(parent, array("I", tokens), 1, tandem_hash, event.adapter)
                if tandem_hash is not None:
                    self._by_tandem.setdefault(tandem_hash, block_hash)
                if run is None:
                    run = BlockStored(block_hashes=[], parent_block_hash=parent, token_ids=[], block_size=size,
                                      chain_hashes=None if tandem_hash is None else [], adapter=event.adapter)
                    passed.append(run)
                run.block_hashes.append(block_hash)
                run.token_ids.extend(tokens)
                if run.chain_hashes is not None:
                    assert tandem_hash is not None  # the run's later blocks chain from its first
                    run.chain_hashes.append(tandem_hash)
            parent = block_hash
        return passed

    def _remove(self, event: BlockRemoved) -> list[KvEvent]:
        gone: list[int] = []
        for block_hash in event.block_hashes:
            cached = self._blocks.get(block_hash)
            if cached is None:
                continue  # stored before an unrecoverable gap, or a tier we do not mirror
            cached.copies -= 1
            if cached.copies == 0:
                del self._blocks[block_hash]
                if cached.tandem_hash is not None and self._by_tandem.get(cached.tandem_hash) == block_hash:
                    del self._by_tandem[cached.tandem_hash]
                gone.append(block_hash)
        return [BlockRemoved(block_hashes=gone)] if gone else []

    def _tandem_hash(self, parent: int | None, tokens: list[int], adapter: str) -> int | None:
        if parent is None:  # the chain's root: the adapter's (vLLM's own hashes include it too)
            return hash_block(adapter_root(adapter), tokens)
        cached_parent = self._blocks.get(parent)
        if cached_parent is None or cached_parent.tandem_hash is None:
            return None
        return hash_block(cached_parent.tandem_hash, tokens)
