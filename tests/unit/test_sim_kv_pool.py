"""KV pool: content derived from the hash, corruption detected, blocks adjacent in memory."""

from __future__ import annotations

import numpy as np

from services.worker.sim.kv_pool import KvPool


def address(view: np.ndarray) -> int:
    return view.__array_interface__["data"][0]


def test_block_size_and_adjacent_layout() -> None:
    pool = KvPool(num_blocks=8, num_layers=4, block_size=16, kv_dim=64)
    assert pool.block_nbytes == 4 * 2 * 16 * 64 * 2
    assert pool.buffer.dtype == np.uint8 and pool.buffer.flags.c_contiguous
    assert pool.buffer.nbytes == 8 * pool.block_nbytes
    base = address(pool.buffer)
    for block_id in (0, 1, 7):
        assert address(pool.block_view(block_id)) == base + pool.block_offset(block_id)
        assert pool.block_view(block_id).size == pool.block_nbytes
    assert address(pool.block_view(3)) + pool.block_nbytes == address(pool.block_view(4))
    assert address(pool.layer_view(2, 1)) == base + 2 * pool.block_nbytes + pool.layer_nbytes


def test_content_is_a_function_of_the_hash() -> None:
    one = KvPool(num_blocks=4, num_layers=2, block_size=16, kv_dim=8)
    two = KvPool(num_blocks=4, num_layers=2, block_size=16, kv_dim=8)
    one.write_block(1, 0xDEADBEEF)
    two.write_block(3, 0xDEADBEEF)
    assert np.array_equal(one.block_view(1), two.block_view(3))
    assert one.checksum(1) == two.checksum(3)
    assert one.verify_block(1, 0xDEADBEEF) and two.verify_block(3, 0xDEADBEEF)
    assert not one.verify_block(1, 0xDEADBEF0)
    assert not np.array_equal(one.layer_view(1, 0), one.layer_view(1, 1))  # layers differ
    one.write_block(2, 0xDEADBEF0)
    assert one.checksum(2) != one.checksum(1)
    assert not one.verify_block(0, 0xDEADBEEF)  # never written: zeros
    assert np.count_nonzero(one.block_view(0)) == 0  # neighbours untouched


def test_verify_detects_a_single_corrupted_byte() -> None:
    pool = KvPool(num_blocks=2, num_layers=3, block_size=16, kv_dim=16)
    pool.write_block(0, 12345)
    before = pool.checksum(0)
    pool.layer_view(0, 2)[100] ^= 0x01
    assert not pool.verify_block(0, 12345)
    assert pool.verify_layer(0, 12345, 0) and not pool.verify_layer(0, 12345, 2)
    assert pool.checksum(0) != before


def test_per_layer_writes() -> None:
    pool = KvPool(num_blocks=2, num_layers=3, block_size=4, kv_dim=4)
    pool.write_block(1, 777, layer=1)
    assert pool.verify_layer(1, 777, 1)
    assert not pool.verify_layer(1, 777, 0) and not pool.verify_block(1, 777)
    for layer in (0, 2):
        pool.write_block(1, 777, layer=layer)
    assert pool.verify_block(1, 777)


def test_sizes_that_are_not_a_multiple_of_16_bytes() -> None:
    pool = KvPool(num_blocks=2, num_layers=2, block_size=3, kv_dim=1)  # 12 bytes a layer
    pool.write_block(0, 42)
    assert pool.verify_block(0, 42) and not pool.verify_block(0, 43)
    assert np.count_nonzero(pool.block_view(0)) > 0 and np.count_nonzero(pool.block_view(1)) == 0
