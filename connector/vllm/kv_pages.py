"""vLLM's KV cache as NIXL sees it: one region of layer-major pages (pure: numpy only).

vLLM (0.32) places every layer's KV cache in one backing allocation. With the CPU
backend's layout (`LBHNC`: layer outermost) block `b` of layer `l` is one contiguous page
at `l * layer_stride + b * page_nbytes`, and consecutive blocks of a layer are adjacent.
Tandem registers the whole allocation once, as a pool of `num_layers * num_blocks` pages
(`connector.nixl_agent.KvAgent` with `block_nbytes = page_nbytes`): page `l * num_blocks + b`
is layer `l` of block `b`. Moving blocks means moving the same block ids in every layer,
so a run of adjacent blocks travels as one descriptor per layer.

Checksums and the byte ranges a transfer moves are the data plane's, from the rank's
`connector.kv_geometry.RankGeometry` (`layer_major`); these pages serve the host tier's
copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from connector.kv_geometry import Tiling


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


AMX_K_TILE_TOKENS = 16  # the AMX kernel's K tile: 16 tokens (an AMX tile's rows)
AMX_V_RUN_DIMS = 16  # its V runs: 16 dimensions each (an AMX tile's 64-byte row of token pairs)


def cpu_tiling(isa: str, head_size: int, block_size: int) -> Tiling:
    """How vLLM's CPU attention kernel (`isa`, `vllm.v1.attention.backends.cpu_attn`) keeps a
    head's K and V in a block, as measured on vLLM 0.32's `cpu_attn_reshape_and_cache`
    (`tests/vllm/test_vllm_kv_tiling.py` checks it against the kernel on every run):
    - `vec`, `vec16`: K dimension-major (one run per dimension, `[d][t]`), V token-major;
    - `amx`: K in tiles of 16 tokens (`[t/16][d/2][t%16][d%2]`: a tile's bytes hold exactly
      its 16 tokens), V in one run per 16 dimensions, two tokens to a tile
      (`[d/16][t/2][d%16][t%2]`).
    Another kernel's tiles are not known here: its blocks move only whole (a tile is the block)."""
    if isa in ("vec", "vec16"):
        return Tiling(k_groups=head_size)
    if isa == "amx":
        return Tiling(k_tile_tokens=AMX_K_TILE_TOKENS, v_groups=head_size // AMX_V_RUN_DIMS, v_tile_tokens=2)
    return Tiling(k_tile_tokens=block_size, v_tile_tokens=block_size)
