"""Byte ranges that move a transfer's tokens between one source rank and one destination
rank of unlike shapes (pure: numpy only).

`plan_ranges` turns `connector.token_map.Segments` into (source offset, destination offset,
length) rows: for every segment, every layer and KV head both ranks hold (narrowed further
by a push's one layer), K and V apart, the segment's token vectors. Rows are ordered by
destination offset and merged where both sides run on, so a whole block whose heads and
layers are contiguous on both sides travels as one range, and adjacent blocks as one.

`read_sources` decides which source rank each part of a destination rank comes from: the
rank that holds it, or with replicated heads one replica, spread by destination rank. A
push writer uses the same rule from the other side (`write_targets`), so exactly one
writer writes every byte a reader needs.

Callers: the readers and writers of a pull or push between workers whose shapes differ
(`connector.mapped_io`), in the reader's worker or in vLLM's model worker ranks.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from connector.descriptors import run_starts
from connector.kv_geometry import KvShape, RankGeometry
from connector.token_map import Segments


class RangePlan(NamedTuple):
    src_offsets: np.ndarray  # into the source rank's registered region
    dst_offsets: np.ndarray  # into the destination rank's region
    lengths: np.ndarray

    def __len__(self) -> int:
        return int(self.lengths.size)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())


class RankPart(NamedTuple):
    """A rectangle of (layers x heads) one destination rank takes from one source rank."""

    src: RankGeometry
    dst: RankGeometry
    layers: range
    heads: range


def _overlap(first: range, second: range) -> range:
    return range(max(first.start, second.start), min(first.stop, second.stop))


def read_sources(dst: RankGeometry, src_shape: KvShape) -> list[RankPart]:
    """Where destination rank `dst` reads each (layer, head) it holds: from the source rank
    holding it; where several do (replicated heads), replica `dst.rank % replicas`."""
    replicas: dict[tuple[range, range], list[RankGeometry]] = {}
    for rank in src_shape.ranks:
        replicas.setdefault((rank.layers, rank.heads), []).append(rank)
    parts = []
    for (layers, heads), group in replicas.items():
        layers, heads = _overlap(layers, dst.layers), _overlap(heads, dst.heads)
        if layers and heads:
            parts.append(RankPart(group[dst.rank % len(group)], dst, layers, heads))
    return parts


def write_targets(src: RankGeometry, src_shape: KvShape, dst_shape: KvShape) -> list[RankPart]:
    """What source rank `src` writes (push mode): for every destination rank, the parts it
    would read from `src` by `read_sources`' rule."""
    return [part for dst in dst_shape.ranks for part in read_sources(dst, src_shape) if part.src.rank == src.rank]


def plan_ranges(part: RankPart, segments: Segments, *, layers: range | None = None) -> RangePlan:
    """The byte ranges of `segments` for the part's layers and heads (only `layers` of
    them when given: one layer of a push), K and V apart, each run of a tiled region apart.
    Both sides must tile K and V alike, and every segment start and length fall on a tile
    (ValueError otherwise: the caller's bug, or a pairing the compatibility hash allows by
    mistake)."""
    src, dst = part.src, part.dst
    span = part.layers if layers is None else _overlap(part.layers, layers)
    if not span or not part.heads or not len(segments):
        empty = np.zeros(0, dtype=np.int64)
        return RangePlan(empty, empty, empty)
    if src.token_nbytes != dst.token_nbytes or src.tiling(0) != dst.tiling(0) or src.tiling(1) != dst.tiling(1):
        raise ValueError(f"ranks of unlike KV regions cannot map: {src.token_nbytes}-byte vectors tiled "
                         f"{src.tiling(0)}/{src.tiling(1)} against {dst.token_nbytes} tiled {dst.tiling(0)}/{dst.tiling(1)}")
    rows = [_kv_rows(part, segments, span, kv) for kv in (0, 1)]
    return merge_ranges(*(np.concatenate([row[index] for row in rows]) for index in range(3)))


def _kv_rows(part: RankPart, segments: Segments, span: range, kv: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    src, dst = part.src, part.dst
    groups, tile = src.tiling(kv)
    if tile > 1 and ((segments.tokens % tile).any() or (segments.src_token % tile).any()
                     or (segments.dst_token % tile).any()):
        raise ValueError(f"a token range does not fall on the {tile}-token tiles of the KV region")
    share = src.token_nbytes // groups  # a token's bytes in one run
    layer = np.arange(span.start, span.stop, dtype=np.int64).reshape(1, -1, 1, 1)
    head = np.arange(part.heads.start, part.heads.stop, dtype=np.int64).reshape(1, 1, -1, 1)
    group = np.arange(groups, dtype=np.int64).reshape(1, 1, 1, -1)
    shape = (len(segments), len(span), len(part.heads), groups)

    def offsets(side: RankGeometry, block: np.ndarray, token: np.ndarray) -> np.ndarray:
        base = side.offset + block * side.block_stride + token * share + kv * side.kv_stride
        inner = ((layer - side.first_layer) * side.layer_stride + (head - side.first_head) * side.head_stride
                 + group * side.block_size * share)
        return np.broadcast_to(base.reshape(-1, 1, 1, 1) + inner, shape).reshape(-1)

    lengths = np.broadcast_to((segments.tokens * share).reshape(-1, 1, 1, 1), shape).reshape(-1)
    return (offsets(src, segments.src_block, segments.src_token), offsets(dst, segments.dst_block, segments.dst_token),
            lengths)


def merge_ranges(src_offsets: np.ndarray, dst_offsets: np.ndarray, lengths: np.ndarray) -> RangePlan:
    """Order rows by destination offset and merge those that run on on both sides."""
    order = np.argsort(dst_offsets, kind="stable")
    src, dst, length = src_offsets[order], dst_offsets[order], lengths[order]
    if length.size <= 1:
        return RangePlan(src.copy(), dst.copy(), length.copy())
    starts = run_starts(src, dst, length)
    return RangePlan(src[starts], dst[starts], np.add.reduceat(length, starts))
