"""Which tokens of which source block land in which destination block, when the two sides'
block sizes differ (pure: numpy only).

A transfer moves tokens [0, num_tokens) of a prompt (counted from the transfer's first
block, which starts a block on both sides): source block `i` holds tokens
[i*Bs, (i+1)*Bs), destination block `k` tokens [k*Bd, (k+1)*Bd). Cutting the range at every
block boundary of either side gives `Segments`, each inside one block on both sides. A
segment belongs to the source block it comes from: that block is the transfer's unit (what
a holder checksums, what fault injection picks, what a failed read marks failed).

Callers: `connector.range_plan` (a segment's bytes, per layer, head and K/V, become one
byte range on each side), `connector.kv_checksums` (a unit's pieces on the reader's side)
and the readers and writers that move a pull's or push's blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class Segments(NamedTuple):
    """Parallel arrays, one entry per segment, in token order."""

    unit: np.ndarray  # index of the source block in the transfer's source list
    src_block: np.ndarray  # source block id
    src_token: np.ndarray  # first token of the segment inside the source block
    dst_block: np.ndarray  # destination block id
    dst_index: np.ndarray  # its position in the transfer's destination list
    dst_token: np.ndarray  # first token inside the destination block
    tokens: np.ndarray  # tokens in the segment

    def __len__(self) -> int:
        return int(self.tokens.size)

    def of_units(self, units: Sequence[int] | np.ndarray) -> Segments:
        """The segments of these units only (a retry of the ones that failed)."""
        keep = np.isin(self.unit, np.asarray(units, dtype=np.int64))
        return Segments(*(array[keep] for array in self))

    def pieces(self, num_units: int) -> list[list[tuple[int, int, int]]]:
        """Per unit, its (destination block, first token, tokens) pieces in token order: what
        a reader checksums to verify the unit."""
        pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(num_units)]
        for unit, block, token, count in zip(self.unit.tolist(), self.dst_block.tolist(), self.dst_token.tolist(),
                                             self.tokens.tolist()):
            pieces[unit].append((block, token, count))
        return pieces

    def destination_ok(self, unit_ok: Sequence[bool], num_destination: int) -> list[bool]:
        """Per destination block: every unit that lands in it is ok (and something does)."""
        return _all_linked_ok(self.dst_index, self.unit, unit_ok, num_destination)

    def units_ok(self, destination_ok: Sequence[bool], num_units: int) -> list[bool]:
        """Per unit: every destination block it lands in is ok (and it lands somewhere)."""
        return _all_linked_ok(self.unit, self.dst_index, destination_ok, num_units)


def _all_linked_ok(side: np.ndarray, other_side: np.ndarray, other_ok: Sequence[bool], count: int) -> list[bool]:
    """Per entry `0..count` of one side: some segment links it to the other side, and every
    entry of the other side it is linked to is ok (`side`, `other_side`: per segment)."""
    ok = np.zeros(count, dtype=bool)
    ok[side] = True
    bad = ~np.asarray(other_ok, dtype=bool)[other_side]
    ok[side[bad]] = False
    return ok.tolist()


def token_segments(src_block_ids: Sequence[int] | np.ndarray, src_block_size: int,
                   dst_block_ids: Sequence[int] | np.ndarray, dst_block_size: int, num_tokens: int) -> Segments:
    """Cut tokens [0, num_tokens) at both sides' block boundaries. Each side's block list
    must cover the tokens (ValueError otherwise: a caller bug)."""
    src = np.asarray(src_block_ids, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst_block_ids, dtype=np.int64).reshape(-1)
    if src_block_size <= 0 or dst_block_size <= 0 or num_tokens < 0:
        raise ValueError("block sizes must be positive and the token count not negative")
    if src.size * src_block_size < num_tokens or dst.size * dst_block_size < num_tokens:
        raise ValueError(f"{src.size} source blocks of {src_block_size} and {dst.size} destination blocks of "
                         f"{dst_block_size} tokens do not both cover {num_tokens} tokens")
    if num_tokens == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Segments(empty, empty, empty, empty, empty, empty, empty)
    if src_block_size == dst_block_size:
        starts = np.arange(0, num_tokens, src_block_size, dtype=np.int64)
    else:
        starts = np.union1d(np.arange(0, num_tokens, src_block_size, dtype=np.int64),
                            np.arange(0, num_tokens, dst_block_size, dtype=np.int64))
    ends = np.empty_like(starts)
    ends[:-1] = starts[1:]
    ends[-1] = num_tokens
    unit = starts // src_block_size
    index = starts // dst_block_size
    return Segments(unit=unit, src_block=src[unit], src_token=starts - unit * src_block_size, dst_block=dst[index],
                    dst_index=index, dst_token=starts % dst_block_size, tokens=ends - starts)


def unit_tokens(num_units: int, block_size: int, num_tokens: int) -> list[int]:
    """Tokens of each source block the transfer covers (the last may be partial)."""
    return [min(block_size, num_tokens - unit * block_size) for unit in range(num_units)]


class Span(NamedTuple):
    """The part of a handle a reader can take whole: from `first_unit`, `units` source blocks
    landing in `local_blocks` of its own blocks from its block `first_local` on."""

    first_unit: int
    units: int
    first_local: int
    local_blocks: int


def aligned_span(src_block_size: int, dst_block_size: int, wanted_units: int, cached_local_blocks: int) -> Span:
    """Where a transfer of `wanted_units` source blocks starts and ends for a reader that has
    its first `cached_local_blocks` blocks cached: at block boundaries of both sides (the
    reader commits whole blocks of its own), so a reader of larger blocks may leave the last
    source blocks out, and one of smaller blocks may read a few it has cached again."""
    big, small = max(src_block_size, dst_block_size), min(src_block_size, dst_block_size)
    if big % small:
        raise ValueError(f"block sizes {src_block_size} and {dst_block_size} do not divide one another")
    end = wanted_units * src_block_size // big * big
    start = min(cached_local_blocks * dst_block_size // big * big, end)
    return Span(first_unit=start // src_block_size, units=(end - start) // src_block_size,
                first_local=start // dst_block_size, local_blocks=(end - start) // dst_block_size)
