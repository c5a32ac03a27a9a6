"""Where a worker's KV lives, rank by rank: the description two workers of unlike shapes
map their blocks through (pure: msgspec and arithmetic only).

A worker serves a model with `tensor_parallel` x `pipeline_parallel` ranks. Each rank keeps
a share of every block: some layers (its pipeline stage) and some KV heads (its tensor-
parallel slice, replicated when there are more ranks than heads). A `RankGeometry` says
where in that rank's registered region a (block, layer, head, K or V, token) lives, as
strides; the token's `token_nbytes` bytes (one head's vector) are contiguous. A `KvShape`
is the worker's block size and its ranks. Both travel in a holder's agent description
(`connector.kv_peer`) and in a pull's order, so a reader plans its reads itself
(`connector.range_plan`) without asking the holder again.

The two layouts Tandem meets today, both head-major inside a page (vLLM's `LBHNC`: per
head, the block's K region then its V region):
- `layer_major`: vLLM's CPU allocation, one page per (layer, block), layer outermost;
- `block_major`: the sim's pools, one contiguous run per block, layers inside it.

Inside a head's K (or V) region an attention kernel may tile the block's vectors: vLLM's
vectorised CPU kernels keep K dimension-major (`vec`: one run of every token per dimension)
and V token-major; its AMX kernel keeps K in tiles of 16 tokens and V in one run per 16
dimensions, two tokens to a tile (`connector.vllm.kv_pages.cpu_tiling`). A region
is `groups` runs of the block's tokens, a token's share of each run `token_nbytes /
groups` bytes, and `tile_tokens` tokens move together: a token range starts and ends on
a tile, and two sides exchange only regions tiled alike (the compatibility hash names the
kernel).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import msgspec


class RankGeometry(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's KV region. Block `b`, layer `l`, head `h`, `kv` 0 (K) or 1 (V), token `t`
    (in the block) is at `offset + b*block_stride + (l - first_layer)*layer_stride +
    (h - first_head)*head_stride + kv*kv_stride + t*token_nbytes`."""

    rank: int
    first_layer: int
    num_layers: int
    first_head: int
    num_heads: int
    num_blocks: int
    block_size: int  # tokens per block
    token_nbytes: int  # one head's K (or V) vector of one token
    block_stride: int
    layer_stride: int
    head_stride: int
    kv_stride: int
    offset: int = 0
    k_groups: int = 1  # runs of a head's K region, each holding every token's share
    v_groups: int = 1
    k_tile_tokens: int = 1  # tokens that move together in K (a tile)
    v_tile_tokens: int = 1

    def tiling(self, kv: int) -> tuple[int, int]:
        """(groups, tile tokens) of K (0) or V (1)."""
        return (self.k_groups, self.k_tile_tokens) if kv == 0 else (self.v_groups, self.v_tile_tokens)

    @property
    def token_align(self) -> int:
        """Token ranges start and end on multiples of this (a block's end aside)."""
        return max(self.k_tile_tokens, self.v_tile_tokens)

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)

    @property
    def heads(self) -> range:
        return range(self.first_head, self.first_head + self.num_heads)

    @property
    def page_nbytes(self) -> int:
        """One layer of one block: every head's K and V vectors."""
        return self.num_heads * 2 * self.block_size * self.token_nbytes

    @property
    def nbytes(self) -> int:
        """The region's extent: one past its last byte."""
        last = self.offset + (self.num_blocks - 1) * self.block_stride + (self.num_layers - 1) * self.layer_stride
        return last + (self.num_heads - 1) * self.head_stride + self.kv_stride + self.block_size * self.token_nbytes

    def validate(self) -> None:
        if min(self.num_layers, self.num_heads, self.num_blocks, self.block_size, self.token_nbytes) <= 0:
            raise ValueError(f"not a KV rank geometry: {self}")
        if min(self.first_layer, self.first_head, self.offset, self.rank) < 0:
            raise ValueError(f"negative index in a KV rank geometry: {self}")
        if self.kv_stride < self.block_size * self.token_nbytes or self.head_stride < 2 * self.kv_stride:
            raise ValueError(f"a head's K and V vectors overlap: {self}")
        for groups, tile in (self.tiling(0), self.tiling(1)):
            if groups <= 0 or tile <= 0 or self.token_nbytes % groups or self.block_size % tile:
                raise ValueError(f"a head's region cannot be cut into {groups} runs of {tile}-token tiles: {self}")

    def address(self, block: int, layer: int, head: int, kv: int, token: int = 0, group: int = 0) -> int:
        """Byte offset of one token's share of run `group` (its whole vector in an untiled
        region: a check of the arithmetic the planner vectorises)."""
        groups = self.tiling(kv)[0]
        return (self.offset + block * self.block_stride + (layer - self.first_layer) * self.layer_stride
                + (head - self.first_head) * self.head_stride + kv * self.kv_stride
                + group * self.block_size * self.token_nbytes // groups + token * self.token_nbytes // groups)


class KvShape(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's KV as a whole: its block size, the model's layers and KV heads, its ranks."""

    block_size: int
    num_layers: int
    num_kv_heads: int
    ranks: list[RankGeometry]

    def validate(self) -> None:
        if not self.ranks:
            raise ValueError("a KV shape needs at least one rank")
        for rank in self.ranks:
            rank.validate()
            if rank.block_size != self.block_size:
                raise ValueError(f"rank {rank.rank} has {rank.block_size}-token blocks, the worker {self.block_size}")
            if rank.layers.stop > self.num_layers or rank.heads.stop > self.num_kv_heads:
                raise ValueError(f"rank {rank.rank} holds layers or heads the model does not have")
        missing = [(layer, head) for layer in range(self.num_layers) for head in range(self.num_kv_heads)
                   if not self.holders(layer, head)]
        if missing:
            raise ValueError(f"no rank holds layer {missing[0][0]} head {missing[0][1]}")

    def holders(self, layer: int, head: int) -> list[RankGeometry]:
        """The ranks that hold this layer of this head (several when heads are replicated)."""
        return [rank for rank in self.ranks if layer in rank.layers and head in rank.heads]

    @property
    def model_block_nbytes(self) -> int:
        """One block of the whole model, every layer and KV head once (K and V): what a
        transfer of one block moves, whatever the ranks."""
        return self.num_layers * self.num_kv_heads * 2 * self.block_size * self.ranks[0].token_nbytes

    @property
    def same_everywhere(self) -> bool:
        """One rank holding everything: the common case, and the fast path's."""
        return len(self.ranks) == 1


class RankSlice(msgspec.Struct, frozen=True, kw_only=True):
    """Which layers and KV heads one rank holds."""

    rank: int
    first_layer: int
    num_layers: int
    first_head: int
    num_heads: int


def rank_slices(num_layers: int, num_kv_heads: int, tensor_parallel: int = 1,
                pipeline_parallel: int = 1) -> list[RankSlice]:
    """The ranks of a TP x PP worker as vLLM numbers and cuts them: rank = stage * TP + tp
    rank; a stage holds a contiguous run of layers (the first `num_layers % PP` stages one
    more); a TP rank holds `heads / TP` consecutive heads, or with more ranks than heads one
    head, replicated on `TP / heads` consecutive ranks (vLLM's `num_kv_head_replicas`)."""
    if tensor_parallel < 1 or pipeline_parallel < 1:
        raise ValueError("tensor and pipeline parallel degrees must be at least 1")
    if pipeline_parallel > num_layers:
        raise ValueError(f"{pipeline_parallel} pipeline stages for {num_layers} layers")
    if num_kv_heads % tensor_parallel and tensor_parallel % num_kv_heads:
        raise ValueError(f"tensor parallel degree {tensor_parallel} neither divides nor is a multiple of "
                         f"the {num_kv_heads} KV heads")
    slices = []
    for stage, (first_layer, count) in enumerate(_stages(num_layers, pipeline_parallel)):
        for tp_rank in range(tensor_parallel):
            if tensor_parallel <= num_kv_heads:
                per_rank = num_kv_heads // tensor_parallel
                first_head, heads = tp_rank * per_rank, per_rank
            else:
                first_head, heads = tp_rank // (tensor_parallel // num_kv_heads), 1
            slices.append(RankSlice(rank=stage * tensor_parallel + tp_rank, first_layer=first_layer,
                                    num_layers=count, first_head=first_head, num_heads=heads))
    return slices


def _stages(num_layers: int, stages: int) -> Iterator[tuple[int, int]]:
    base, extra = divmod(num_layers, stages)
    first = 0
    for stage in range(stages):
        count = base + (1 if stage < extra else 0)
        yield first, count
        first += count


class Tiling(NamedTuple):
    """How a kernel tiles a head's K and V regions (see the module's docstring)."""

    k_groups: int = 1
    k_tile_tokens: int = 1
    v_groups: int = 1
    v_tile_tokens: int = 1


def layer_major(part: RankSlice, *, num_blocks: int, block_size: int, token_nbytes: int, offset: int = 0,
                tiling: Tiling = Tiling()) -> RankGeometry:
    """vLLM's CPU layout (`LBHNC`): layer `l`'s pages fill `num_blocks` pages, block by
    block; a page is every head's K region then V region, tiled as the kernel keeps them."""
    kv_stride = block_size * token_nbytes
    page = part.num_heads * 2 * kv_stride
    return RankGeometry(rank=part.rank, first_layer=part.first_layer, num_layers=part.num_layers,
                        first_head=part.first_head, num_heads=part.num_heads, num_blocks=num_blocks,
                        block_size=block_size, token_nbytes=token_nbytes, block_stride=page,
                        layer_stride=num_blocks * page, head_stride=2 * kv_stride, kv_stride=kv_stride,
                        offset=offset, k_groups=tiling.k_groups, k_tile_tokens=tiling.k_tile_tokens,
                        v_groups=tiling.v_groups, v_tile_tokens=tiling.v_tile_tokens)


def block_major(part: RankSlice, *, num_blocks: int, block_size: int, token_nbytes: int) -> RankGeometry:
    """The sim's layout: a block is one contiguous run of its layers' pages (a page as in
    `layer_major`), so whole blocks move as one descriptor and adjacent blocks merge."""
    kv_stride = block_size * token_nbytes
    page = part.num_heads * 2 * kv_stride
    return RankGeometry(rank=part.rank, first_layer=part.first_layer, num_layers=part.num_layers,
                        first_head=part.first_head, num_heads=part.num_heads, num_blocks=num_blocks,
                        block_size=block_size, token_nbytes=token_nbytes, block_stride=part.num_layers * page,
                        layer_stride=page, head_stride=2 * kv_stride, kv_stride=kv_stride)
