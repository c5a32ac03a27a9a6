"""Byte-range planning: rows checked against their pools, adjacent rows merged, descriptor
rows built; and block plans refused for a peer whose blocks are another size. Pure: no NIXL."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from connector.agent_types import PoolInfo
from connector.descriptors import (
    ByteRanges,
    byte_ranges,
    check_ranges,
    coalesce_ranges,
    plan_blocks,
    plan_ranges,
    range_descriptors,
)


def rows(ranges: ByteRanges) -> list[tuple[int, int, int]]:
    return list(zip(ranges.local_offsets.tolist(), ranges.remote_offsets.tolist(), ranges.lengths.tolist()))


def merged(local, remote, lengths) -> list[tuple[int, int, int]]:
    return rows(coalesce_ranges(byte_ranges(local, remote, lengths)))


def test_rows_adjacent_on_both_sides_merge():
    assert merged([0, 100, 300], [1000, 1100, 1300], [100, 200, 50]) == [(0, 1000, 350)]


def test_a_gap_on_either_side_splits():
    assert merged([0, 100], [1000, 1101], [100, 10]) == [(0, 1000, 100), (100, 1101, 10)]
    assert merged([0, 101], [1000, 1100], [100, 10]) == [(0, 1000, 100), (101, 1100, 10)]


def test_the_given_order_is_kept_and_not_sorted():
    # adjacent only if sorted: the planner's order is its plan, so these stay apart
    assert merged([100, 0], [1100, 1000], [100, 100]) == [(100, 1100, 100), (0, 1000, 100)]
    # runs merge wherever they are in the list
    assert merged([500, 0, 10, 20], [0, 50, 60, 70], [5, 10, 10, 1]) == [(500, 0, 5), (0, 50, 21)]


def test_empty_and_single_rows():
    assert merged([], [], []) == []
    assert merged([7], [9], [3]) == [(7, 9, 3)]


@pytest.mark.parametrize("local,remote,lengths", [([0, 1], [0], [1, 1]), ([0], [0], [1, 2]), ([0], [0], [0]),
                                                  ([0], [0], [-4])])
def test_mismatched_or_non_positive_rows_are_bugs(local, remote, lengths):
    with pytest.raises(ValueError):
        byte_ranges(local, remote, lengths)


def test_ranges_must_lie_inside_the_pool():
    check_ranges(np.array([0, 96]), np.array([4, 4]), 100, "local", disjoint=True)
    with pytest.raises(ValueError, match=r"local range \[97, 101\) is outside the 100-byte pool"):
        check_ranges(np.array([0, 97]), np.array([4, 4]), 100, "local", disjoint=False)
    with pytest.raises(ValueError, match="remote range"):
        check_ranges(np.array([-1]), np.array([4]), 100, "remote", disjoint=False)


def test_destination_ranges_must_not_overlap():
    check_ranges(np.array([10, 0]), np.array([5, 10]), 100, "local", disjoint=True)  # apart, unsorted
    check_ranges(np.array([0, 2]), np.array([5, 5]), 100, "remote", disjoint=False)  # a source may overlap
    with pytest.raises(ValueError, match="overlap"):
        check_ranges(np.array([0, 2]), np.array([5, 5]), 100, "local", disjoint=True)
    with pytest.raises(ValueError, match="overlap"):
        check_ranges(np.array([50, 0, 48]), np.array([10, 10, 3]), 100, "local", disjoint=True)


def test_descriptor_rows_are_addresses_lengths_and_device():
    got = range_descriptors(0x1000, np.array([0, 64]), np.array([16, 8]), device_id=3)
    assert got.dtype == np.uint64 and got.tolist() == [[0x1000, 16, 3], [0x1040, 8, 3]]


LOCAL = PoolInfo(base_addr=0x10000, block_nbytes=256, num_blocks=8, device_id=1)
REMOTE = PoolInfo(base_addr=0x90000, block_nbytes=1024, num_blocks=4)


def test_a_range_plan_merges_and_checks_against_both_pools():
    plan = plan_ranges(LOCAL, REMOTE, [0, 256, 1024], [512, 768, 0], [256, 256, 100], into_local=True)
    assert plan.local_rows.tolist() == [[0x10000, 512, 1], [0x10000 + 1024, 100, 1]]
    assert plan.remote_rows.tolist() == [[0x90000 + 512, 512, 0], [0x90000, 100, 0]]
    assert plan.nbytes == 612 and plan.num_blocks == 0 and not plan.refusal
    with pytest.raises(ValueError, match="local range"):
        plan_ranges(LOCAL, REMOTE, [LOCAL.nbytes - 1], [0], [2], into_local=True)
    with pytest.raises(ValueError, match="remote ranges overlap"):
        plan_ranges(LOCAL, REMOTE, [0, 100], [0, 50], [100, 100], into_local=False)
    # reading, only the local side is a destination: the same rows are fine
    assert len(plan_ranges(LOCAL, REMOTE, [0, 100], [0, 50], [100, 100], into_local=True).local_rows) == 2


def test_a_block_plan_for_a_peer_of_another_block_size_is_refused_with_both_sizes():
    plan = plan_blocks(LOCAL, REMOTE, [0], [0], into_local=True)
    assert "1024-byte blocks" in plan.refusal and "256-byte blocks" in plan.refusal
    assert len(plan.local_rows) == 0 and plan.nbytes == 0
    same = plan_blocks(LOCAL, LOCAL, [1, 2], [5, 6], into_local=True)
    assert not same.refusal and same.local_rows.tolist() == [[0x10000 + 256, 512, 1]]


row = st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(1, 12))


@given(st.lists(row, max_size=30))
def test_merging_moves_the_same_bytes_in_fewer_rows_and_misses_no_merge(given_rows):
    local, remote, lengths = (list(column) for column in zip(*given_rows)) if given_rows else ([], [], [])
    ranges = byte_ranges(local, remote, lengths)
    result = coalesce_ranges(ranges)

    def byte_pairs(r: ByteRanges) -> list[tuple[int, int]]:  # every byte's (local, remote), in order
        return [(lo + i, re + i) for lo, re, n in rows(r) for i in range(n)]

    assert byte_pairs(result) == byte_pairs(ranges)
    assert len(result) <= len(ranges) and result.nbytes == ranges.nbytes
    ends = result.lengths[:-1]
    assert not np.any((result.local_offsets[:-1] + ends == result.local_offsets[1:])
                      & (result.remote_offsets[:-1] + ends == result.remote_offsets[1:]))
    assert rows(coalesce_ranges(result)) == rows(result)  # idempotent


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 10)), max_size=12))
def test_the_overlap_check_agrees_with_counting_bytes(given_rows):
    offsets = np.array([offset for offset, _ in given_rows], dtype=np.int64)
    lengths = np.array([length for _, length in given_rows], dtype=np.int64)
    covered = [offset + i for offset, length in given_rows for i in range(length)]
    overlapping = len(covered) != len(set(covered))
    if overlapping:
        with pytest.raises(ValueError, match="overlap"):
            check_ranges(offsets, lengths, 100, "local", disjoint=True)
    else:
        check_ranges(offsets, lengths, 100, "local", disjoint=True)
