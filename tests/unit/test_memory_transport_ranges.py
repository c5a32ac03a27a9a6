"""The in-memory transport's byte ranges: bytes land exactly, between pools of unlike block
size; bounds, deadlines, unknown peers; block transfers to such a peer fail naming both
sizes; fault injection passes ranges through. No NIXL, no NATS."""

from __future__ import annotations

import numpy as np
import pytest

from connector import memory_transport
from connector.faults import FaultInjectingTransport
from connector.memory_transport import MemoryFabric, MemoryTransport
from shared.config import KvFaultConfig

POOL_NBYTES = 16 * 1024
SMALL, LARGE = 256, 1024  # block sizes of the two sides


def transport(fabric: MemoryFabric, name: str, block_nbytes: int, seed: int) -> tuple[MemoryTransport, np.ndarray]:
    pool = np.random.default_rng(seed).integers(0, 256, POOL_NBYTES, dtype=np.uint8)
    return MemoryTransport(name, pool, block_nbytes, block_nbytes // 4, fabric=fabric), pool


def unlike_pair() -> tuple[MemoryTransport, np.ndarray, MemoryTransport, np.ndarray]:
    fabric = MemoryFabric()
    small, small_pool = transport(fabric, "small", SMALL, 1)
    large, large_pool = transport(fabric, "large", LARGE, 2)
    small.add_peer("large", large.metadata())
    large.add_peer("small", small.metadata())
    return small, small_pool, large, large_pool


def landed(target: np.ndarray, source: np.ndarray, target_offsets, source_offsets, lengths) -> np.ndarray:
    expected = target.copy()
    for t, s, n in zip(target_offsets, source_offsets, lengths):
        expected[t:t + n] = source[s:s + n]
    return expected


async def test_read_ranges_between_unlike_blocks_lands_exactly_those_bytes() -> None:
    small, small_pool, large, large_pool = unlike_pair()
    remote, local, lengths = [0, 100, 5000], [300, 400, 16_000], [100, 50, 384]
    expected = landed(small_pool, large_pool, local, remote, lengths)
    result = await small.read_ranges("large", remote, local, lengths, timeout_s=1.0)
    assert result.outcome == "done" and result.ok == [True] and result.nbytes == 534
    assert np.array_equal(small_pool, expected)
    small.close()
    large.close()


async def test_write_ranges_lands_in_the_peer_and_large_ranges_copy_in_chunks(monkeypatch) -> None:
    monkeypatch.setattr(memory_transport, "_CHUNK_NBYTES", 1000)  # several chunks per range
    small, small_pool, large, large_pool = unlike_pair()
    remote, local, lengths = np.array([10, 9000]), np.array([0, 4000]), np.array([4000, 3333])
    expected = landed(large_pool, small_pool, remote, local, lengths)
    result = await small.write_ranges("large", remote, local, lengths, timeout_s=1.0)
    assert result.outcome == "done" and result.ok == [True] and result.nbytes == 7333
    assert np.array_equal(large_pool, expected)
    empty = await small.write_ranges("large", [], [], [], timeout_s=1.0)
    assert empty.outcome == "done" and empty.nbytes == 0
    small.close()
    large.close()


async def test_block_transfers_to_a_peer_of_another_block_size_fail_naming_both() -> None:
    small, small_pool, large, _ = unlike_pair()
    before = small_pool.copy()
    read = await small.read("large", [0, 1], [0, 1], timeout_s=1.0)
    write = await small.write("large", [0], [0], timeout_s=1.0, layer=1)
    for result in (read, write):
        assert result.outcome == "failed" and not any(result.ok)
        assert "1024-byte blocks" in result.reason and "256-byte blocks" in result.reason
    assert read.ok == [False, False] and np.array_equal(small_pool, before)
    small.close()
    large.close()


async def test_ranges_outside_a_pool_or_overlapping_are_bugs() -> None:
    small, _, large, _ = unlike_pair()
    with pytest.raises(ValueError, match="remote range"):
        await small.read_ranges("large", [POOL_NBYTES - 1], [0], [2], timeout_s=1.0)
    with pytest.raises(ValueError, match="local ranges overlap"):
        await small.read_ranges("large", [0, 500], [0, 10], [20, 20], timeout_s=1.0)
    with pytest.raises(ValueError, match="lengths"):
        await small.write_ranges("large", [0], [0], [0], timeout_s=1.0)
    small.close()
    large.close()


async def test_unknown_gone_late_and_closed_range_transfers_are_results() -> None:
    small, _, large, _ = unlike_pair()
    unknown = await small.read_ranges("nobody", [0], [0], [1], timeout_s=1.0)
    assert unknown.outcome == "failed" and unknown.ok == [False] and "unknown" in unknown.reason
    late = await small.read_ranges("large", [0], [0], [POOL_NBYTES], timeout_s=-1.0)
    assert late.outcome == "failed" and late.ok == [False] and "in time" in late.reason
    large.close()
    gone = await small.read_ranges("large", [0], [0], [1], timeout_s=1.0)
    assert gone.outcome == "failed" and "gone" in gone.reason
    small.close()
    closed = await small.read_ranges("large", [0], [0], [1], timeout_s=1.0)
    assert closed.outcome == "cancelled" and closed.ok == [False]


async def test_fault_injection_passes_range_transfers_through() -> None:
    small, small_pool, large, large_pool = unlike_pair()
    faulty = FaultInjectingTransport(small, KvFaultConfig(fail_transfer=True), small_pool, SMALL)
    result = await faulty.read_ranges("large", [LARGE], [0], [SMALL], timeout_s=1.0)
    assert result.outcome == "done" and np.array_equal(small_pool[:SMALL], large_pool[LARGE:LARGE + SMALL])
    result = await faulty.write_ranges("large", [0], [SMALL], [10], timeout_s=1.0)
    assert result.outcome == "done" and np.array_equal(large_pool[:10], small_pool[SMALL:SMALL + 10])
    faulty.close()
    large.close()
