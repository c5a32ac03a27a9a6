"""Descriptor planning: block id pairs -> coalesced runs -> NIXL descriptor rows."""

from __future__ import annotations

import numpy as np
import pytest

from connector.agent_types import PoolInfo
from connector.descriptors import check_block_ids, coalesce_block_runs, expand_runs, plan_blocks, run_descriptors


def runs_as_tuples(local, remote):
    runs = coalesce_block_runs(local, remote)
    return list(zip(runs.local_starts.tolist(), runs.remote_starts.tolist(), runs.counts.tolist()))


def test_adjacent_pairs_merge_into_one_run():
    assert runs_as_tuples(range(8), range(100, 108)) == [(0, 100, 8)]


def test_a_break_on_either_side_splits_the_run():
    # local 0..3 is contiguous, but remote jumps after the second block
    assert runs_as_tuples([0, 1, 2, 3], [10, 11, 20, 21]) == [(0, 10, 2), (2, 20, 2)]
    # remote contiguous, local jumps
    assert runs_as_tuples([0, 1, 5, 6], [10, 11, 12, 13]) == [(0, 10, 2), (5, 12, 2)]


def test_pairs_are_ordered_by_local_id_before_merging():
    # allocated in reverse: still one run once ordered
    assert runs_as_tuples([7, 6, 5, 4], [3, 2, 1, 0]) == [(4, 0, 4)]
    assert runs_as_tuples([5, 3, 4, 9], [10, 8, 9, 1]) == [(3, 8, 3), (9, 1, 1)]


def test_descending_remote_ids_do_not_merge():
    assert runs_as_tuples([0, 1, 2], [5, 4, 3]) == [(0, 5, 1), (1, 4, 1), (2, 3, 1)]


def test_empty_and_single():
    assert runs_as_tuples([], []) == []
    assert runs_as_tuples([3], [9]) == [(3, 9, 1)]
    assert len(coalesce_block_runs([], [])) == 0


def test_mismatched_lengths_are_a_bug():
    with pytest.raises(ValueError):
        coalesce_block_runs([1, 2], [1])


def test_runs_cover_exactly_the_requested_pairs():
    rng = np.random.default_rng(7)
    for _ in range(50):
        n = int(rng.integers(1, 200))
        local = rng.choice(1000, n, replace=False)
        # mix of runs and scatter: sorted slices of a permutation plus some shuffling
        remote = rng.permutation(1000)[:n] if rng.random() < 0.5 else local + int(rng.integers(0, 50))
        runs = coalesce_block_runs(local, remote)
        got = set(zip(expand_runs(runs.local_starts, runs.counts).tolist(),
                      expand_runs(runs.remote_starts, runs.counts).tolist()))
        assert got == set(zip(local.tolist(), remote.tolist()))
        assert runs.num_blocks == n
        # maximal: no two consecutive runs could have been merged
        ends_local = runs.local_starts[:-1] + runs.counts[:-1]
        ends_remote = runs.remote_starts[:-1] + runs.counts[:-1]
        assert not np.any((ends_local == runs.local_starts[1:]) & (ends_remote == runs.remote_starts[1:]))


def test_whole_block_descriptors_one_row_per_run():
    rows = run_descriptors(0x1000, 256, np.array([0, 4]), np.array([3, 1]), device_id=2)
    assert rows.dtype == np.uint64
    assert rows.tolist() == [[0x1000, 768, 2], [0x1000 + 4 * 256, 256, 2]]


def test_layer_descriptors_one_row_per_block():
    # a layer is a strided sub-range: neighbouring blocks' layers are not contiguous
    rows = run_descriptors(0, 1024, np.array([2]), np.array([3]), offset=256, length=128)
    assert rows.tolist() == [[2 * 1024 + 256, 128, 0], [3 * 1024 + 256, 128, 0], [4 * 1024 + 256, 128, 0]]


def test_a_layer_spanning_the_whole_block_still_merges():
    rows = run_descriptors(0, 1024, np.array([2]), np.array([3]), offset=0, length=1024)
    assert rows.tolist() == [[2048, 3072, 0]]


@pytest.mark.parametrize("offset,length", [(-1, 10), (0, 0), (1000, 100), (0, 1025)])
def test_ranges_outside_a_block_are_a_bug(offset, length):
    with pytest.raises(ValueError):
        run_descriptors(0, 1024, np.array([0]), np.array([1]), offset=offset, length=length)


def test_block_id_checks():
    check_block_ids(np.array([0, 5, 9]), 10, "local", unique=True)
    check_block_ids(np.array([3, 3]), 10, "remote", unique=False)
    check_block_ids(np.array([], dtype=np.int64), 10, "local", unique=True)
    with pytest.raises(ValueError, match="out of range"):
        check_block_ids(np.array([0, 10]), 10, "local", unique=True)
    with pytest.raises(ValueError, match="out of range"):
        check_block_ids(np.array([4, -1]), 10, "local", unique=True)
    with pytest.raises(ValueError, match="repeat"):
        check_block_ids(np.array([4, 2, 4]), 10, "local", unique=True)


def test_expand_runs_inverts_coalescing():
    assert expand_runs(np.array([5, 0]), np.array([2, 3])).tolist() == [5, 6, 0, 1, 2]
    assert expand_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64)).tolist() == []


def test_a_single_run_plan_checks_its_ends_and_matches_the_general_path():
    local = PoolInfo(base_addr=0x1000, block_nbytes=256, num_blocks=10, device_id=1)
    remote = PoolInfo(base_addr=0x8000, block_nbytes=256, num_blocks=20)
    plan = plan_blocks(local, remote, range(2, 8), range(10, 16), into_local=True)
    assert plan.local_rows.tolist() == [[0x1000 + 2 * 256, 6 * 256, 1]]
    assert plan.remote_rows.tolist() == [[0x8000 + 10 * 256, 6 * 256, 0]]
    assert (plan.num_blocks, plan.nbytes) == (6, 6 * 256)
    layer = plan_blocks(local, remote, range(2, 4), range(10, 12), into_local=False, offset=64, length=32)
    assert layer.local_rows.tolist() == [[0x1000 + 2 * 256 + 64, 32, 1], [0x1000 + 3 * 256 + 64, 32, 1]]
    assert layer.nbytes == 64
    with pytest.raises(ValueError, match=r"local block id out of range \[0, 10\): 10"):
        plan_blocks(local, remote, range(5, 11), range(0, 6), into_local=True)
    with pytest.raises(ValueError, match=r"remote block id out of range \[0, 20\): -1"):
        plan_blocks(local, remote, range(0, 3), range(-1, 2), into_local=True)
