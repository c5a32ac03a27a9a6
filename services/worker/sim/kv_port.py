"""The sim's side of KV transfers: pins, blocks received from a peer (pure, synchronous).

`SimEngine` implements `connector.port.KvPort` by delegating here; the connector is
the only caller, through the engine. Pins are block references like a request's, so the
block manager's invariants cover them: a pinned block is never evicted or reallocated,
and `used_blocks` drops back to zero only once every pin is released.

Received KV is trusted only after two checks: the sender's checksum (the connector's `ok`)
and the bytes against the chain hash of the tokens (`KvPool.verify_block`), so a block that
arrived garbled, or under the wrong hash, never enters the prefix cache.
"""

from __future__ import annotations

from itertools import groupby, islice, takewhile

from services.worker.sim.block_manager import BlockManager
from services.worker.sim.kv_pool import KvPool
from shared.block_hash import adapter_root, block_hash_chain


class SimKvPort:
    def __init__(self, blocks: BlockManager, pool: KvPool) -> None:
        assert pool.num_blocks == blocks.num_blocks and pool.block_size == blocks.block_size
        self.blocks = blocks
        self.pool = pool

    def pin_prefix(self, block_hashes: list[int]) -> list[tuple[int, int]]:
        """Pin the longest cached leading run of `block_hashes`: [(block_id, checksum)]. The
        run goes on into the host tier: the blocks there that continue it are loaded back into
        the device tier (as many as it has room for), their KV bytes with them, so that a peer
        reads them as any other (a prefix pull from this worker's host tier). The load costs
        no engine time here: it is a copy beside the engine's steps."""
        block_ids = self.blocks.match_prefix(block_hashes)
        self.blocks.touch(block_ids)
        hosted = list(islice(takewhile(self.blocks.in_host, block_hashes[len(block_ids):]), self.blocks.free_blocks))
        loaded = self.blocks.load_from_host(hosted) if hosted else None  # one reference each, as a pin takes
        if loaded:
            for block_id, block_hash in zip(loaded, hosted):
                self.pool.write_block(block_id, block_hash)
            block_ids += loaded
        return [(block_id, self.pool.checksum(block_id)) for block_id in block_ids]

    def pin_blocks(self, block_ids: list[int]) -> None:
        self.blocks.pin(block_ids)

    def allocate_for_transfer(self, num_blocks: int) -> list[int] | None:
        return self.blocks.allocate(num_blocks)

    def unpin(self, block_ids: list[int]) -> None:
        self.blocks.free(block_ids)

    def commit_transferred(self, block_ids: list[int], block_hashes: list[int], token_ids: list[int],
                           parent_hash: int | None, ok: list[bool], *, adapter: str = "") -> list[bool]:
        """Cache the received blocks that verify; per block, whether its KV is now cached here.

        Consecutive verified blocks are committed together (one `BlockStored`). A hash that
        is already cached keeps its block: the received one stays private until unpinned.
        """
        size = self.blocks.block_size
        assert len(block_ids) == len(block_hashes) == len(ok) and len(token_ids) == len(block_ids) * size
        # The chain the tokens imply: a hash that disagrees names KV these tokens do not have.
        chain = block_hash_chain(token_ids, size, parent_hash=adapter_root(adapter) if parent_hash is None else parent_hash)
        verified = [arrived and block_hash == expected and self.pool.verify_block(block_id, block_hash)
                    for arrived, block_id, block_hash, expected in zip(ok, block_ids, block_hashes, chain)]
        for good, run in groupby(range(len(block_ids)), key=verified.__getitem__):
            if not good:
                continue
            indices = list(run)
            first, stop = indices[0], indices[-1] + 1
            self.blocks.commit(block_ids[first:stop], block_hashes[first:stop], token_ids[first * size:stop * size],
                               chain[first - 1] if first else parent_hash, adapter=adapter)
        return verified

    def checksum(self, block_id: int) -> int:
        return self.pool.checksum(block_id)

    def verify(self, block_id: int, block_hash: int) -> bool:
        return self.pool.verify_block(block_id, block_hash)
