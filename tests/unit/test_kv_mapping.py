"""The pure mapping between workers of unlike shapes: rank slices, token segments, byte
ranges and unit checksums, checked by moving real bytes between numpy regions laid out as
the sim and vLLM lay them out, for random shapes (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.kv_checksums import combine_unit_sums, unit_digest, unit_sums
from connector.kv_geometry import KvShape, RankGeometry, Tiling, block_major, layer_major, rank_slices
from connector.range_plan import merge_ranges, plan_ranges, read_sources, write_targets
from connector.token_map import token_segments, unit_tokens


def make_shape(layout: str, *, layers: int, heads: int, tp: int, pp: int, block_size: int, num_blocks: int,
               token_nbytes: int, tiling: Tiling = Tiling()) -> KvShape:
    if layout == "layer":
        ranks = [layer_major(part, num_blocks=num_blocks, block_size=block_size, token_nbytes=token_nbytes,
                             tiling=tiling) for part in rank_slices(layers, heads, tp, pp)]
    else:
        ranks = [block_major(part, num_blocks=num_blocks, block_size=block_size, token_nbytes=token_nbytes)
                 for part in rank_slices(layers, heads, tp, pp)]
    shape = KvShape(block_size=block_size, num_layers=layers, num_kv_heads=heads, ranks=ranks)
    shape.validate()
    return shape


def shares(rank, block: int, layer: int, head: int, kv: int, slot: int):
    """Where each run's share of one token's vector lives: (start, end) in the vector, and the
    region's offset."""
    groups = rank.tiling(kv)[0]
    share = rank.token_nbytes // groups
    for group in range(groups):
        yield group * share, (group + 1) * share, rank.address(block, layer, head, kv, slot, group)


def placements(rank, block_ids: list[int], block_size: int, tokens: int):
    """Every share of the rank's vectors for the first `tokens` tokens in `block_ids`: its
    logical index (token, layer, head, kv), (start, end) in the vector, and the region's offset."""
    for token in range(tokens):
        block, slot = block_ids[token // block_size], token % block_size
        for layer in rank.layers:
            for head in rank.heads:
                for kv in (0, 1):
                    for first, last, start in shares(rank, block, layer, head, kv, slot):
                        yield (token, layer, head, kv), first, last, start


def fill(shape: KvShape, logical: np.ndarray, block_ids: list[int], tokens: int) -> list[np.ndarray]:
    """Regions holding `logical[token, layer, head, kv]` vectors in the given blocks."""
    regions = []
    for rank in shape.ranks:
        region = np.zeros(rank.nbytes, dtype=np.uint8)
        for vector, first, last, start in placements(rank, block_ids, shape.block_size, tokens):
            region[start:start + last - first] = logical[(*vector, slice(first, last))]
        regions.append(region)
    return regions


def check(shape: KvShape, regions: list[np.ndarray], logical: np.ndarray, block_ids: list[int], tokens: int) -> None:
    for rank, region in zip(shape.ranks, regions):
        for vector, first, last, start in placements(rank, block_ids, shape.block_size, tokens):
            assert np.array_equal(region[start:start + last - first], logical[(*vector, slice(first, last))]), \
                (rank.rank, *vector)


def apply(plan, src: np.ndarray, dst: np.ndarray) -> None:
    for src_offset, dst_offset, length in zip(plan.src_offsets.tolist(), plan.dst_offsets.tolist(),
                                              plan.lengths.tolist()):
        dst[dst_offset:dst_offset + length] = src[src_offset:src_offset + length]


def parallel_degrees(heads: int):
    return st.sampled_from([degree for degree in (1, 2, 4, 8) if heads % degree == 0 or degree % heads == 0])


@st.composite
def transfers(draw):
    layers = draw(st.integers(1, 4))
    heads = draw(st.sampled_from([1, 2, 4]))
    token_nbytes = draw(st.sampled_from([4, 8]))
    tiled = draw(st.booleans())  # vLLM's CPU kernels' tiles (K by dimension pairs, V by token pairs)
    tiling = Tiling(k_groups=token_nbytes // 2, v_tile_tokens=2) if tiled else Tiling()
    sizes = draw(st.lists(st.sampled_from([2, 4, 8] if tiled else [1, 2, 4, 8]), min_size=2, max_size=2))
    tokens = draw(st.integers(1, 20)) * (2 if tiled else 1)
    sides = []
    for block_size in sizes:
        count = -(-tokens // block_size)
        num_blocks = count + draw(st.integers(0, 3))
        block_ids = draw(st.permutations(range(num_blocks)))[:count]
        shape = make_shape("layer" if tiled else draw(st.sampled_from(["layer", "block"])), layers=layers,
                           heads=heads, tp=draw(parallel_degrees(heads)), pp=draw(st.integers(1, layers)),
                           block_size=block_size, num_blocks=num_blocks, token_nbytes=token_nbytes, tiling=tiling)
        sides.append((shape, list(block_ids)))
    seed = draw(st.integers(0, 2**32 - 1))
    return sides, tokens, seed


@settings(max_examples=150, deadline=None)
@given(transfers())
def test_every_destination_rank_reads_exactly_its_share(case) -> None:
    (src_shape, src_blocks), (dst_shape, dst_blocks), tokens, seed = *case[0], case[1], case[2]
    logical = np.random.default_rng(seed).integers(
        0, 256, (tokens, src_shape.num_layers, src_shape.num_kv_heads, 2, src_shape.ranks[0].token_nbytes),
        dtype=np.uint8)
    src_regions = fill(src_shape, logical, src_blocks, tokens)
    dst_regions = [np.zeros(rank.nbytes, dtype=np.uint8) for rank in dst_shape.ranks]
    segments = token_segments(src_blocks, src_shape.block_size, dst_blocks, dst_shape.block_size, tokens)
    for dst_rank, region in zip(dst_shape.ranks, dst_regions):
        for part in read_sources(dst_rank, src_shape):
            apply(plan_ranges(part, segments), src_regions[part.src.rank], region)
    check(dst_shape, dst_regions, logical, dst_blocks, tokens)

    # The holder's checksums equal the reader's, unit by unit and head by head.
    units = len(src_blocks)
    held = [[(block, 0, count)] for block, count in zip(src_blocks, unit_tokens(units, src_shape.block_size, tokens))]
    expected = combine_unit_sums([(rank, unit_sums(region, rank, held)) for rank, region in
                                  zip(src_shape.ranks, src_regions)], src_shape.num_layers, src_shape.num_kv_heads)
    pieces = segments.pieces(units)
    got = combine_unit_sums([(rank, unit_sums(region, rank, pieces)) for rank, region in
                             zip(dst_shape.ranks, dst_regions)], dst_shape.num_layers, dst_shape.num_kv_heads)
    assert np.array_equal(expected, got)


@settings(max_examples=60, deadline=None)
@given(transfers())
def test_writers_cover_every_destination_byte_once(case) -> None:
    (src_shape, src_blocks), (dst_shape, dst_blocks), tokens, _ = *case[0], case[1], case[2]
    segments = token_segments(src_blocks, src_shape.block_size, dst_blocks, dst_shape.block_size, tokens)
    written: dict[int, list[tuple[int, int]]] = {rank.rank: [] for rank in dst_shape.ranks}
    for src_rank in src_shape.ranks:
        for part in write_targets(src_rank, src_shape, dst_shape):
            plan = plan_ranges(part, segments)
            written[part.dst.rank] += list(zip(plan.dst_offsets.tolist(), plan.lengths.tolist()))
    for rank in dst_shape.ranks:
        covered = np.zeros(rank.nbytes, dtype=np.int64)
        for offset, length in written[rank.rank]:
            covered[offset:offset + length] += 1
        assert covered.max() <= 1  # never written twice
        assert covered.sum() == tokens * len(rank.layers) * len(rank.heads) * 2 * rank.token_nbytes


def test_same_shape_whole_blocks_merge_into_runs() -> None:
    shape = make_shape("block", layers=3, heads=2, tp=1, pp=1, block_size=4, num_blocks=16, token_nbytes=8)
    segments = token_segments([2, 3, 4, 9], 4, [5, 6, 7, 1], 4, 16)
    (part,) = read_sources(shape.ranks[0], shape)
    plan = plan_ranges(part, segments)
    assert plan.lengths.tolist() == [shape.ranks[0].block_stride, 3 * shape.ranks[0].block_stride]
    # vLLM's layout: a run of adjacent blocks is one range per layer
    shape = make_shape("layer", layers=3, heads=2, tp=1, pp=1, block_size=4, num_blocks=16, token_nbytes=8)
    (part,) = read_sources(shape.ranks[0], shape)
    assert len(plan_ranges(part, token_segments([0, 1, 2], 4, [3, 4, 5], 4, 12))) == 3


def test_one_layer_of_a_push() -> None:
    shape = make_shape("layer", layers=4, heads=2, tp=2, pp=1, block_size=4, num_blocks=8, token_nbytes=8)
    segments = token_segments([0, 1], 4, [2, 3], 4, 8)
    part = read_sources(shape.ranks[1], shape)[0]
    plan = plan_ranges(part, segments, layers=range(2, 3))
    assert plan.nbytes == 8 * 1 * 2 * 8  # tokens x heads of the rank x (K, V) x bytes, one layer


def test_segments_cut_at_both_block_sizes() -> None:
    segments = token_segments([7, 8], 4, [1, 2, 3, 4], 2, 7)
    assert segments.unit.tolist() == [0, 0, 1, 1]
    assert segments.tokens.tolist() == [2, 2, 2, 1]
    assert segments.dst_block.tolist() == [1, 2, 3, 4]
    assert segments.src_token.tolist() == [0, 2, 0, 2]
    with pytest.raises(ValueError, match="cover"):
        token_segments([1], 4, [1], 2, 3)


def test_rank_slices_follow_vllm() -> None:
    assert [(part.first_head, part.num_heads) for part in rank_slices(2, 2, 4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [(part.first_layer, part.num_layers) for part in rank_slices(5, 2, 1, 2)] == [(0, 3), (3, 2)]
    with pytest.raises(ValueError, match="neither divides"):
        rank_slices(2, 4, 3)


def test_geometry_refuses_overlapping_vectors() -> None:
    rank = block_major(rank_slices(1, 1)[0], num_blocks=2, block_size=4, token_nbytes=8)
    bad = RankGeometry(**{**{name: getattr(rank, name) for name in rank.__struct_fields__}, "kv_stride": 8})
    with pytest.raises(ValueError, match="overlap"):
        bad.validate()


def test_combining_needs_every_layer_of_every_head() -> None:
    shape = make_shape("block", layers=2, heads=2, tp=1, pp=2, block_size=2, num_blocks=2, token_nbytes=4)
    sums = np.zeros((1, 2), dtype=np.uint64)
    with pytest.raises(ValueError, match="layer 1"):
        combine_unit_sums([(shape.ranks[0], sums)], 2, 2)


def test_a_changed_byte_changes_the_unit() -> None:
    rank = block_major(rank_slices(2, 1)[0], num_blocks=1, block_size=2, token_nbytes=4)
    region = np.arange(rank.nbytes, dtype=np.uint8)
    before = unit_sums(region, rank, [[(0, 0, 2)]])
    region[rank.address(0, 1, 0, 1, 1)] ^= 1
    assert unit_sums(region, rank, [[(0, 0, 2)]])[0, 0] != before[0, 0]
    assert unit_digest([1, 2]) != unit_digest([2, 1])


def test_merge_keeps_rows_apart_unless_both_sides_run_on() -> None:
    plan = merge_ranges(np.array([0, 10, 4]), np.array([0, 8, 4]), np.array([4, 4, 4]))
    assert plan.dst_offsets.tolist() == [0, 8] and plan.lengths.tolist() == [8, 4]


def test_unlike_tiles_and_tokens_off_a_tile_are_refused() -> None:
    vec = make_shape("layer", layers=1, heads=1, tp=1, pp=1, block_size=4, num_blocks=4, token_nbytes=8,
                     tiling=Tiling(k_groups=8))
    amx = make_shape("layer", layers=1, heads=1, tp=1, pp=1, block_size=4, num_blocks=4, token_nbytes=8,
                     tiling=Tiling(k_groups=4, v_tile_tokens=2))
    (part,) = read_sources(amx.ranks[0], vec)
    with pytest.raises(ValueError, match="unlike KV regions"):
        plan_ranges(part, token_segments([0], 4, [1], 4, 4))
    (part,) = read_sources(amx.ranks[0], amx)
    with pytest.raises(ValueError, match="tiles"):
        plan_ranges(part, token_segments([0], 4, [1], 4, 3))
    assert plan_ranges(part, token_segments([0], 4, [1], 4, 2)).nbytes == 2 * 8 * 2  # two tokens' K and V


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (4, 2)])
def test_a_model_block_is_the_sum_of_every_ranks_pages(tp: int, pp: int) -> None:
    """A transfer record's bytes per block: the same whatever the ranks (sim and vLLM alike)."""
    shape = make_shape("layer", layers=4, heads=8, tp=tp, pp=pp, block_size=16, num_blocks=3, token_nbytes=128)
    assert shape.model_block_nbytes == sum(rank.page_nbytes * rank.num_layers for rank in shape.ranks)
    assert shape.model_block_nbytes == 4 * 8 * 2 * 16 * 128
