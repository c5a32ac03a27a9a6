"""What a holder vouches for and a reader checks, whatever either side's shape (pure).

The unit is one source block and one KV head: its checksum is the sum (mod 2^64), over the
model's layers, of a mix of the layer index with the CRC-32 of that layer's bytes of the
head, K vectors of the block's tokens first, then V vectors, in token order. Both sides
compute it over the same logical bytes, each from its own layout: a holder at TP 2 from
each rank's heads, a reader with another block size from the pieces of its own blocks the
unit's tokens landed in (`connector.token_map`). Because it is a sum over layers, the
stages of a pipeline-parallel worker each add their layers (`combine_unit_sums`); because
it is per head, a tensor-parallel rank checks exactly the heads it holds.

A handle's `checksums` are these values, unit by unit, head by head (`units x heads`).
Callers: holders when they grant a lease, readers after a read (`connector.mapped_io`,
the sim's port, vLLM's model worker), push writers and receivers.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from connector.kv_geometry import RankGeometry

_MASK = (1 << 64) - 1
Piece = tuple[int, int, int]  # (block id, first token in the block, tokens)


def _mix(value: int) -> int:
    """splitmix64's finaliser: the layer's term of a unit's sum."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


def unit_sums(region: np.ndarray, geometry: RankGeometry, units: Sequence[Sequence[Piece]]) -> np.ndarray:
    """This rank's share of each unit's checksum: `(units, geometry.num_heads)` uint64, the
    sum over its layers. `region` is the rank's registered memory, flat uint8; each unit
    is its pieces in token order (one `(block, 0, tokens)` piece on the holder's side). A
    layer's bytes are read K then V, each run of a tiled region in turn (`kv_geometry`),
    the pieces' tokens within each run: the same order whatever the block size."""
    data = memoryview(region.reshape(-1))
    sums = np.zeros((len(units), geometry.num_heads), dtype=np.uint64)
    runs = [(kv, group, geometry.token_nbytes // geometry.tiling(kv)[0]) for kv in (0, 1)
            for group in range(geometry.tiling(kv)[0])]
    for index, pieces in enumerate(units):
        whole = len(pieces) == 1 and pieces[0][1] == 0 and pieces[0][2] == geometry.block_size \
            and geometry.kv_stride == geometry.block_size * geometry.token_nbytes
        for head in geometry.heads:
            total = 0
            for layer in geometry.layers:
                if whole:  # K then V of one whole block: one contiguous run
                    start = geometry.address(pieces[0][0], layer, head, 0)
                    crc = zlib.crc32(data[start:start + 2 * geometry.kv_stride])
                else:
                    crc = 0
                    for kv, group, share in runs:
                        for block, token, count in pieces:
                            start = geometry.address(block, layer, head, kv, token, group)
                            crc = zlib.crc32(data[start:start + count * share], crc)
                total = (total + _mix(crc | (layer << 32))) & _MASK
            sums[index, head - geometry.first_head] = total
    return sums


def combine_unit_sums(parts: Sequence[tuple[RankGeometry, np.ndarray]], num_layers: int, num_kv_heads: int, *,
                      heads: Sequence[int] | None = None) -> np.ndarray:
    """The checksums of some heads (all by default), `(units, heads)`, from ranks'
    `unit_sums`: each head summed over one rank per pipeline stage (replicas counted once).
    Raises if a wanted head misses a layer in the ranks given."""
    if not parts:
        raise ValueError("no rank's sums to combine")
    wanted = list(range(num_kv_heads)) if heads is None else list(heads)
    column = {head: index for index, head in enumerate(wanted)}
    total = np.zeros((parts[0][1].shape[0], len(wanted)), dtype=np.uint64)
    covered = np.zeros((num_layers, num_kv_heads), dtype=bool)
    for geometry, sums in parts:
        for local, head in enumerate(geometry.heads):
            if head not in column or covered[geometry.first_layer, head]:  # unwanted, or a replica's
                continue
            covered[geometry.layers.start:geometry.layers.stop, head] = True
            total[:, column[head]] += sums[:, local]  # uint64 wraps: the sum mod 2^64
    missing = np.argwhere(~covered[:, wanted])
    if missing.size:
        layer, index = missing[0]
        raise ValueError(f"no rank's sums cover layer {layer} of head {wanted[index]}")
    return total


def complete_heads(ranks: Sequence[RankGeometry], num_layers: int) -> list[int]:
    """The heads these ranks hold in every layer: what they can check on their own."""
    layers: dict[int, set[int]] = {}
    for rank in ranks:
        for head in rank.heads:
            layers.setdefault(head, set()).update(rank.layers)
    return sorted(head for head, held in layers.items() if len(held) == num_layers)


def unit_digest(values: Sequence[int] | np.ndarray) -> int:
    """One number for a unit's checksums over some heads: what `read_verified` compares."""
    digest = 0
    for value in np.asarray(values, dtype=np.uint64).tolist():
        digest = _mix(digest ^ value)
    return digest
