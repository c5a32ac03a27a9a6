"""The sim's side of KV transfers: pins, blocks received from a peer (pure, synchronous).

`SimEngine` implements `connector.port.KvPort` by delegating here; the connector is
the only caller, through the engine. Pins are block references like a request's, so the
block manager's invariants cover them: a pinned block is never evicted or reallocated,
and `used_blocks` drops back to zero only once every pin is released.

Received KV is trusted only after two checks: the sender's checksums (the connector's `ok`)
and the bytes against the tokens (`KvPool.verify_block`, from the seed before them), so a
block that arrived garbled, from the wrong place, or under the wrong hash, never enters the
prefix cache.
"""

from __future__ import annotations

from itertools import groupby, islice, takewhile

from connector.kv_checksums import Piece
from services.worker.sim.block_manager import BlockManager
from services.worker.sim.kv_content import block_seeds
from services.worker.sim.kv_pool import KvPool
from shared.block_hash import block_hash_chain, chain_root


class SimKvPort:
    def __init__(self, blocks: BlockManager, pool: KvPool) -> None:
        assert pool.num_blocks == blocks.num_blocks and pool.block_size == blocks.block_size
        self.blocks = blocks
        self.pool = pool

    def pin_prefix(self, block_hashes: list[int]) -> list[int]:
        """Pin the longest cached leading run of `block_hashes`: its block ids. The run goes on
        into the host tier: the blocks there that continue it are loaded back into the device
        tier (as many as it has room for), their KV bytes with them, so that a peer reads them
        as any other (a prefix pull from this worker's host tier). The load costs no engine
        time here: it is a copy beside the engine's steps."""
        block_ids = self.blocks.match_prefix(block_hashes)
        self.blocks.touch(block_ids)
        hosted = list(islice(takewhile(self.blocks.in_host, block_hashes[len(block_ids):]), self.blocks.free_blocks))
        loaded = self.blocks.load_from_host(hosted) if hosted else None  # one reference each, as a pin takes
        if loaded:
            for block_id in loaded:
                seed, token_ids = self.blocks.content(block_id)
                self.pool.write_block(block_id, seed, token_ids)
            block_ids += loaded
        return block_ids

    def pin_blocks(self, block_ids: list[int]) -> None:
        self.blocks.pin(block_ids)

    def allocate_for_transfer(self, num_blocks: int) -> list[int] | None:
        return self.blocks.allocate(num_blocks)

    def unpin(self, block_ids: list[int]) -> None:
        self.blocks.free(block_ids)

    def commit_transferred(self, block_ids: list[int], first_block: int, token_ids: list[int], ok: list[bool], *,
                           adapter: str = "", cache_salt: str = "") -> list[bool]:
        """Cache the received blocks that verify; per block, whether its KV is now cached here.

        `block_ids[i]` holds block `first_block + i` of `token_ids` (the whole sequence): its
        chain hash and its bytes follow from the tokens before and in it. Consecutive verified
        blocks are committed together (one `BlockStored`). A hash that is already cached keeps
        its block: the received one stays private until unpinned.
        """
        size = self.blocks.block_size
        count = len(block_ids)
        stop = first_block + count
        assert len(ok) == count and len(token_ids) >= stop * size
        root = chain_root(adapter, cache_salt)
        chain = block_hash_chain(token_ids[:stop * size], size, parent_hash=root)
        seeds = block_seeds(root, token_ids, size, stop)
        verified = [arrived and self.pool.verify_block(block_id, seeds[first_block + index],
                                                       token_ids[(first_block + index) * size:
                                                                 (first_block + index + 1) * size])
                    for index, (arrived, block_id) in enumerate(zip(ok, block_ids))]
        for good, run in groupby(range(count), key=verified.__getitem__):
            if not good:
                continue
            indices = list(run)
            first, last = first_block + indices[0], first_block + indices[-1] + 1
            self.blocks.commit(block_ids[indices[0]:indices[-1] + 1], chain[first:last], token_ids[first * size:last * size],
                               chain[first - 1] if first else None, adapter=adapter, cache_salt=cache_salt,
                               seeds=seeds[first:last])
        return verified

    def block_checksums(self, block_ids: list[int]) -> list[int]:
        """Checksums of whole blocks, block by block, head by head (a holder's, for a handle)."""
        return self.pool.block_checksums(block_ids)

    def unit_checksums(self, units: list[list[Piece]]) -> list[int]:
        """Checksums of units made of pieces of these blocks (a reader's), flat."""
        return self.pool.unit_checksums(units).reshape(-1).tolist()
