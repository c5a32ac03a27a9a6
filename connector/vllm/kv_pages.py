"""vLLM's KV cache as NIXL sees it: one region of layer-major pages (pure: numpy only).

vLLM (0.32) places every layer's KV cache in one backing allocation. With the CPU
backend's layout (`LBHNC`: layer outermost) block `b` of layer `l` is one contiguous page
at `l * layer_stride + b * page_nbytes`, and consecutive blocks of a layer are adjacent.
Tandem registers the whole allocation once, as a pool of `num_layers * num_blocks` pages
(`connector.nixl_agent.KvAgent` with `block_nbytes = page_nbytes`): page `l * num_blocks + b`
is layer `l` of block `b`. Moving blocks means moving the same block ids in every layer,
so a run of adjacent blocks travels as one descriptor per layer.

The checksum of a block is CRC-32 over its pages in layer order: holder and reader compute
it with this same function.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import msgspec
import numpy as np


class PageGeometry(msgspec.Struct, frozen=True, kw_only=True):
    num_layers: int
    num_blocks: int  # vLLM's KV blocks (block 0 is its null block)
    page_nbytes: int  # one layer of one block

    @property
    def num_pages(self) -> int:
        return self.num_layers * self.num_blocks

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_nbytes

    def validate(self) -> None:
        if self.num_layers <= 0 or self.num_blocks <= 0 or self.page_nbytes <= 0:
            raise ValueError(f"not a KV page geometry: {self}")


def page_ids(block_ids: Sequence[int] | np.ndarray, num_layers: int, num_blocks: int) -> np.ndarray:
    """The pool pages of `block_ids` in every layer, layer by layer: for layer l, block b is
    page l * num_blocks + b. Pairs of (local, remote) ids expanded with the same order stay
    paired, and adjacent block ids stay adjacent pages within each layer."""
    blocks = np.asarray(block_ids, dtype=np.int64).reshape(1, -1)
    layers = np.arange(num_layers, dtype=np.int64).reshape(-1, 1) * num_blocks
    return (layers + blocks).reshape(-1)


def block_checksum(pages: np.ndarray, geometry: PageGeometry, block_id: int) -> int:
    """CRC-32 of one block's bytes: its page in each layer, in layer order.

    `pages` is the pool as a (num_pages, page_nbytes) uint8 array."""
    crc = 0
    for layer in range(geometry.num_layers):
        crc = zlib.crc32(pages[layer * geometry.num_blocks + block_id], crc)
    return crc


def scribble(pages: np.ndarray, geometry: PageGeometry, block_id: int) -> None:
    """Make a block garbage (a failed transfer's partly written bytes), deterministically."""
    for layer in range(geometry.num_layers):
        pages[layer * geometry.num_blocks + block_id, ::7] ^= 0x5A
