"""Real KV bytes in DRAM for the sim, with content that is a function of the tokens.

Layout: one uint8 array `[num_blocks, num_layers, 2 (k, v), block_size, kv_dim * 2]`
(fp16-sized elements), so a block is one contiguous range and consecutive block ids are
adjacent in memory: the NIXL data plane registers `buffer` once and moves whole blocks
(pull) or one layer of a block at a time (push, `layer_view`); adjacent blocks merge into
one descriptor.

A block's content is derived from a content hash: for a full block, its Tandem block hash
(the chain hash covers the whole prefix, like real KV does); for a partially filled block,
`hash_block(parent, tokens so far)`. A receiver that knows the tokens can therefore verify
every byte it got (`verify_block`). The scheduler writes blocks as it computes them.
"""

from __future__ import annotations

import zlib

import numpy as np

_MASK64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """splitmix64 finaliser: a cheap, well-spread 64-bit mix."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def layer_pattern(content_hash: int, layer: int) -> np.ndarray:
    """The 16-byte pattern (two uint64) that fills one layer of a block."""
    first = _mix64(content_hash ^ (layer << 1))
    second = _mix64(first ^ ((layer << 1) | 1))
    return np.array([first, second], dtype=np.uint64)


class KvPool:
    def __init__(self, num_blocks: int, num_layers: int, block_size: int, kv_dim: int) -> None:
        assert num_blocks > 0 and num_layers > 0 and block_size > 0 and kv_dim > 0
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.block_size = block_size
        self.kv_dim = kv_dim
        # np.zeros maps pages lazily: an unused pool costs no resident memory.
        self.buffer = np.zeros((num_blocks, num_layers, 2, block_size, kv_dim * 2), dtype=np.uint8)
        self.layer_nbytes = 2 * block_size * kv_dim * 2
        self.block_nbytes = num_layers * self.layer_nbytes
        # The fast path views a layer as rows of 16 bytes; other sizes fall back to a tiled copy.
        self._rows_of_16 = self.layer_nbytes % 16 == 0

    def block_view(self, block_id: int) -> np.ndarray:
        """The block's bytes, flat (a view, not a copy)."""
        return self.buffer[block_id].reshape(-1)

    def layer_view(self, block_id: int, layer: int) -> np.ndarray:
        """One layer of one block, flat (a view, not a copy)."""
        return self.buffer[block_id, layer].reshape(-1)

    def block_offset(self, block_id: int) -> int:
        """Byte offset of a block from the start of `buffer`."""
        return block_id * self.block_nbytes

    def write_block(self, block_id: int, content_hash: int, layer: int | None = None) -> None:
        """Fill a block (all layers, or one) with the bytes `content_hash` stands for."""
        layers = range(self.num_layers) if layer is None else (layer,)
        for index in layers:
            self._fill(self.layer_view(block_id, index), layer_pattern(content_hash, index))

    def verify_block(self, block_id: int, content_hash: int) -> bool:
        """Whether every byte of the block is what `content_hash` stands for."""
        return all(self.verify_layer(block_id, content_hash, layer) for layer in range(self.num_layers))

    def verify_layer(self, block_id: int, content_hash: int, layer: int) -> bool:
        view = self.layer_view(block_id, layer)
        pattern = layer_pattern(content_hash, layer)
        if self._rows_of_16:
            return bool(np.array_equal(view.view(np.uint64).reshape(-1, 2), np.broadcast_to(pattern, (view.size // 16, 2))))
        return bool(np.array_equal(view, np.resize(pattern.view(np.uint8), view.size)))

    def checksum(self, block_id: int) -> int:
        """CRC-32 of the block's bytes (cheap; for comparing copies across workers)."""
        return zlib.crc32(self.buffer[block_id].data)

    def _fill(self, view: np.ndarray, pattern: np.ndarray) -> None:
        if self._rows_of_16:
            view.view(np.uint64).reshape(-1, 2)[:] = pattern
        else:
            view[:] = np.resize(pattern.view(np.uint8), view.size)
