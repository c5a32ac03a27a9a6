"""Real KV bytes in DRAM for the sim, one region per rank, with content a function of the
tokens (`kv_content`).

A sim worker of tensor-parallel degree TP and pipeline-parallel degree PP keeps TP x PP
ranks, each with its own region, registered with its own transport (NIXL agent): a rank
holds its layers and KV heads of every block (`connector.kv_geometry.rank_slices`), laid
out block-major (`connector.kv_geometry.block_major`): `[block, layer, head, K|V, token,
head vector]`, so a block is one contiguous range per rank and consecutive block ids are
adjacent. Every rank shares the engine's block ids (one block table, as in vLLM).

A block's bytes are those of its tokens after the prefix whose hash is its `seed`, so a
reader that knows its tokens verifies every byte it got (`verify_block`), whatever shape
the holder had. Checksums are the data plane's per-head unit sums (`connector.kv_checksums`).
The scheduler writes blocks as it computes them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from connector.kv_checksums import Piece, combine_unit_sums, unit_sums
from connector.kv_geometry import KvShape, block_major, rank_slices
from services.worker.sim.kv_content import prefix_hashes, token_vectors

ELEMENT_NBYTES = 2  # the sim's KV is fp16-sized


class KvPool:
    def __init__(self, num_blocks: int, num_layers: int, block_size: int, kv_dim: int, *, num_kv_heads: int = 1,
                 tensor_parallel: int = 1, pipeline_parallel: int = 1) -> None:
        assert num_blocks > 0 and num_layers > 0 and block_size > 0 and kv_dim > 0 and num_kv_heads > 0
        if kv_dim % num_kv_heads:
            raise ValueError(f"a KV dimension of {kv_dim} does not split into {num_kv_heads} heads")
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.token_nbytes = kv_dim // num_kv_heads * ELEMENT_NBYTES
        ranks = [block_major(part, num_blocks=num_blocks, block_size=block_size, token_nbytes=self.token_nbytes)
                 for part in rank_slices(num_layers, num_kv_heads, tensor_parallel, pipeline_parallel)]
        self.shape = KvShape(block_size=block_size, num_layers=num_layers, num_kv_heads=num_kv_heads, ranks=ranks)
        self.shape.validate()
        # np.zeros maps pages lazily: an unused pool costs no resident memory.
        self.regions = [np.zeros(rank.nbytes, dtype=np.uint8) for rank in ranks]
        self._views = [region.reshape(num_blocks, rank.num_layers, rank.num_heads, 2, block_size, self.token_nbytes)
                       for region, rank in zip(self.regions, ranks)]
        # One block of the whole model: every layer and head once (what a transfer moves).
        self.block_nbytes = num_layers * num_kv_heads * 2 * block_size * self.token_nbytes
        self.layer_nbytes = self.block_nbytes // num_layers

    def write_block(self, block_id: int, seed: int, token_ids: Sequence[int], layer: int | None = None) -> None:
        """Write the KV of `token_ids` (the block's first tokens, all of them or a partial
        block's) after the prefix hashed as `seed`, in every rank (or one layer)."""
        prefixes = prefix_hashes(seed, token_ids)
        count = len(token_ids)
        for rank, view in zip(self.shape.ranks, self._views):
            layers = rank.layers if layer is None else range(layer, layer + 1)
            if layer is not None and layer not in rank.layers:
                continue
            vectors = token_vectors(prefixes, layers, rank.heads, self.token_nbytes)
            first = layers.start - rank.first_layer
            view[block_id, first:first + len(layers), :, :, :count, :] = vectors

    def verify_block(self, block_id: int, seed: int, token_ids: Sequence[int]) -> bool:
        """Whether every byte of the block's first `len(token_ids)` tokens, in every rank, is
        the KV of these tokens after `seed`."""
        prefixes = prefix_hashes(seed, token_ids)
        count = len(token_ids)
        return all(np.array_equal(view[block_id, :, :, :, :count, :],
                                  token_vectors(prefixes, rank.layers, rank.heads, self.token_nbytes))
                   for rank, view in zip(self.shape.ranks, self._views))

    def unit_checksums(self, units: Sequence[Sequence[Piece]]) -> np.ndarray:
        """The data plane's checksums of these units (`(units, heads)`), over every rank."""
        parts = [(rank, unit_sums(region, rank, units)) for rank, region in zip(self.shape.ranks, self.regions)]
        return combine_unit_sums(parts, self.num_layers, self.num_kv_heads)

    def block_checksums(self, block_ids: Sequence[int]) -> list[int]:
        """A holder's checksums of whole blocks, flat: block by block, head by head."""
        return self.unit_checksums([[(block_id, 0, self.block_size)] for block_id in block_ids]).reshape(-1).tolist()

    def block_view(self, block_id: int, rank: int = 0) -> np.ndarray:
        """One rank's bytes of a block, flat (a view, not a copy)."""
        return self._views[rank][block_id].reshape(-1)

    def scribble(self, block_id: int) -> None:
        """Make a block garbage in every rank (a partly written block), deterministically."""
        for view in self._views:
            view[block_id].reshape(-1)[::7] ^= 0x5A
