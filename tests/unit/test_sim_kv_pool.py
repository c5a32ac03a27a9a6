"""KV pool: content a function of the tokens and the prefix before them (whatever the block
size or rank layout), corruption detected, blocks adjacent in memory, ranks sharing the
block ids."""

from __future__ import annotations

import numpy as np
import pytest

from services.worker.sim.kv_content import advance, block_seeds
from services.worker.sim.kv_pool import KvPool

TOKENS = list(range(100, 164))


def address(view: np.ndarray) -> int:
    return view.__array_interface__["data"][0]


def test_block_size_and_adjacent_layout() -> None:
    pool = KvPool(num_blocks=8, num_layers=4, block_size=16, kv_dim=64, num_kv_heads=4)
    assert pool.block_nbytes == 4 * 2 * 16 * 64 * 2
    (region,) = pool.regions
    assert region.dtype == np.uint8 and region.flags.c_contiguous and region.nbytes == 8 * pool.block_nbytes
    assert address(pool.block_view(3)) + pool.block_nbytes == address(pool.block_view(4))
    assert address(pool.block_view(0)) == address(region)


def test_ranks_split_heads_and_layers_and_share_block_ids() -> None:
    pool = KvPool(num_blocks=4, num_layers=4, block_size=8, kv_dim=32, num_kv_heads=4, tensor_parallel=2,
                  pipeline_parallel=2)
    assert [(rank.layers, rank.heads) for rank in pool.shape.ranks] == [
        (range(0, 2), range(0, 2)), (range(0, 2), range(2, 4)), (range(2, 4), range(0, 2)), (range(2, 4), range(2, 4))]
    assert sum(region.nbytes for region in pool.regions) == 4 * pool.block_nbytes
    pool.write_block(2, 7, TOKENS[:8])
    assert pool.verify_block(2, 7, TOKENS[:8])
    assert all(np.count_nonzero(pool.block_view(2, rank)) for rank in range(4))
    assert not any(np.count_nonzero(pool.block_view(1, rank)) for rank in range(4))  # neighbours untouched


def test_content_follows_the_tokens_not_the_block_size() -> None:
    small = KvPool(num_blocks=8, num_layers=2, block_size=4, kv_dim=8, num_kv_heads=2)
    large = KvPool(num_blocks=4, num_layers=2, block_size=8, kv_dim=8, num_kv_heads=2)
    seeds = block_seeds(5, TOKENS, 4, 4)
    for index, seed in enumerate(seeds):
        small.write_block(index, seed, TOKENS[index * 4:(index + 1) * 4])
    large.write_block(0, 5, TOKENS[:8])
    large.write_block(1, advance(5, TOKENS[:8]), TOKENS[8:16])
    # the same tokens after the same prefix: the same checksums, cut at 4 or 8 tokens
    pieces = [[(0, 0, 4), (1, 0, 4)], [(2, 0, 4), (3, 0, 4)]]
    assert np.array_equal(small.unit_checksums(pieces), large.unit_checksums([[(0, 0, 8)], [(1, 0, 8)]]))
    assert large.verify_block(1, seeds[2], TOKENS[8:16])
    assert not large.verify_block(1, seeds[1], TOKENS[8:16])  # another prefix, other KV
    assert not large.verify_block(1, seeds[2], [0] + TOKENS[9:16])


def test_verify_detects_a_single_corrupted_byte() -> None:
    pool = KvPool(num_blocks=2, num_layers=3, block_size=16, kv_dim=16, num_kv_heads=2, tensor_parallel=2)
    pool.write_block(0, 12345, TOKENS[:16])
    before = pool.block_checksums([0])
    pool.block_view(0, 1)[100] ^= 0x01
    assert not pool.verify_block(0, 12345, TOKENS[:16])
    after = pool.block_checksums([0])
    assert after[0] == before[0] and after[1] != before[1]  # head 1 lives in rank 1


def test_per_layer_writes() -> None:
    pool = KvPool(num_blocks=2, num_layers=3, block_size=4, kv_dim=4, pipeline_parallel=3)
    pool.write_block(1, 777, TOKENS[:4], layer=1)
    assert not pool.verify_block(1, 777, TOKENS[:4])
    for layer in (0, 2):
        pool.write_block(1, 777, TOKENS[:4], layer=layer)
    assert pool.verify_block(1, 777, TOKENS[:4])


def test_sizes_that_are_not_a_multiple_of_16_bytes() -> None:
    pool = KvPool(num_blocks=2, num_layers=2, block_size=3, kv_dim=1)  # 2-byte head vectors
    pool.write_block(0, 42, TOKENS[:3])
    assert pool.verify_block(0, 42, TOKENS[:3]) and not pool.verify_block(0, 43, TOKENS[:3])
    assert np.count_nonzero(pool.block_view(0)) > 0 and np.count_nonzero(pool.block_view(1)) == 0


def test_a_shape_the_model_cannot_take_is_refused() -> None:
    with pytest.raises(ValueError, match="neither divides"):
        KvPool(num_blocks=2, num_layers=2, block_size=4, kv_dim=12, num_kv_heads=3, tensor_parallel=2)
    with pytest.raises(ValueError, match="split into"):
        KvPool(num_blocks=2, num_layers=2, block_size=4, kv_dim=10, num_kv_heads=4)
