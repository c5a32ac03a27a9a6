"""Pure descriptor planning for KV transfers: block ids or byte ranges in, NIXL descriptor
rows out.

A KV pool is one registered region of `num_blocks` blocks, each `block_nbytes` long, block
`b` at `base + b * block_nbytes`. A block transfer pairs local with remote block ids. Pairs
whose ids both advance by one are one contiguous byte range on each side, so they travel as
one larger descriptor: fewer descriptors is what lets a transfer of adjacent blocks run at
memory bandwidth instead of per-descriptor overhead. A byte-range transfer (between pools of
unlike geometry, planned elsewhere) pairs byte offsets into each pool with lengths; rows
adjacent on both sides, consecutive in the given order, merge the same way.

Callers: `KvAgent` (connector/nixl_agent.py) through `plan_blocks` / `plan_ranges`, and
`MemoryTransport` (the checks and `coalesce_ranges`). Nothing here does I/O or touches
NIXL; a descriptor row is `(address, length, device_id)` as NIXL's `nixlXferDList` takes it.
Arguments a correct caller never passes (ids or ranges outside a pool, two copies into one
destination) raise ValueError.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from connector.agent_types import PoolInfo

Ints = Sequence[int] | np.ndarray


class BlockRuns(NamedTuple):
    """Runs of consecutive block pairs: run i covers `counts[i]` blocks starting at
    `local_starts[i]` locally and at `remote_starts[i]` on the peer."""

    local_starts: np.ndarray
    remote_starts: np.ndarray
    counts: np.ndarray

    def __len__(self) -> int:
        return int(self.counts.size)

    @property
    def num_blocks(self) -> int:
        return int(self.counts.sum())


def as_block_ids(block_ids: Ints) -> np.ndarray:
    if type(block_ids) is np.ndarray and block_ids.dtype == np.int64 and block_ids.ndim == 1:
        return block_ids  # as given: a conversion costs microseconds per transfer
    return np.asarray(block_ids, dtype=np.int64).reshape(-1)


def coalesce_block_runs(local_ids: Ints, remote_ids: Ints) -> BlockRuns:
    """Merge (local, remote) pairs into runs where both ids advance by one.

    Pairs are ordered by local id first: the order of descriptors within one transfer
    does not matter, and sorting finds runs a caller's ordering would hide (a request's
    blocks are often allocated in reverse). Duplicate or out-of-range ids are the caller's
    to reject; here they simply do not merge.
    """
    local = as_block_ids(local_ids)
    remote = as_block_ids(remote_ids)
    if local.size != remote.size:
        raise ValueError(f"{local.size} local block ids but {remote.size} remote block ids")
    if local.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return BlockRuns(empty, empty, empty)
    # Slicing rather than np.diff: this runs per transfer and np.diff's overhead adds up.
    if not (local[1:] > local[:-1]).all():
        order = np.lexsort((remote, local))
        local, remote = local[order], remote[order]
    breaks = np.flatnonzero((local[1:] - local[:-1] != 1) | (remote[1:] - remote[:-1] != 1)) + 1
    starts = np.zeros(breaks.size + 1, dtype=np.int64)
    starts[1:] = breaks
    counts = np.empty_like(starts)
    counts[:-1] = breaks - starts[:-1]
    counts[-1] = local.size - starts[-1]
    return BlockRuns(local[starts], remote[starts], counts)


def run_descriptors(base_addr: int, block_nbytes: int, starts: np.ndarray, counts: np.ndarray,
                    device_id: int = 0, *, offset: int = 0, length: int | None = None) -> np.ndarray:
    """Descriptor rows (address, length, device_id) as an Nx3 uint64 array.

    Whole blocks (`offset == 0`, `length` None or `block_nbytes`): one row per run.
    A sub-range of each block (one layer in a block-major pool, for push mode): one row per
    block, because the same range of neighbouring blocks is not contiguous.
    """
    if length is None:
        length = block_nbytes
    if offset < 0 or length <= 0 or offset + length > block_nbytes:
        raise ValueError(f"range [{offset}, {offset + length}) is not inside a {block_nbytes}-byte block")
    starts = np.asarray(starts, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    if length == block_nbytes and starts.size == 1:  # the common case, in one array operation
        return np.array([[base_addr + int(starts[0]) * block_nbytes, int(counts[0]) * block_nbytes, device_id]],
                        dtype=np.uint64)
    if length == block_nbytes:
        rows = np.empty((starts.size, 3), dtype=np.uint64)
        rows[:, 0] = base_addr + starts * block_nbytes
        rows[:, 1] = counts * block_nbytes
    else:
        block_ids = expand_runs(starts, counts)
        rows = np.empty((block_ids.size, 3), dtype=np.uint64)
        rows[:, 0] = base_addr + block_ids * block_nbytes + offset
        rows[:, 1] = length
    rows[:, 2] = device_id
    return rows


def expand_runs(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The block ids that runs cover, in run order: the inverse of coalescing."""
    starts = np.asarray(starts, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    if starts.size == 0:
        return np.zeros(0, dtype=np.int64)
    run_begin = np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + (np.arange(int(counts.sum())) - run_begin)


def check_block_ids(block_ids: np.ndarray, num_blocks: int, side: str, *, unique: bool) -> None:
    """Raise ValueError for ids outside the pool, or repeated ids where they must be unique
    (a transfer's destination: two copies into one block is a caller bug)."""
    if block_ids.size == 0:
        return
    if (block_ids[1:] > block_ids[:-1]).all():  # the common case, and cheap: sorted means unique
        low, high, repeats = int(block_ids[0]), int(block_ids[-1]), False
    else:
        ordered = np.sort(block_ids)
        low, high = int(ordered[0]), int(ordered[-1])
        repeats = unique and bool((ordered[1:] == ordered[:-1]).any())
    if low < 0 or high >= num_blocks:
        raise ValueError(f"{side} block id out of range [0, {num_blocks}): {low if low < 0 else high}")
    if repeats:
        raise ValueError(f"{side} block ids repeat")


class TransferPlan(NamedTuple):
    """One transfer's descriptor rows on each side (Nx3 uint64, row i local -> row i remote
    or back), or why the transfer cannot be made at all (`refusal`, rows empty)."""

    local_rows: np.ndarray
    remote_rows: np.ndarray
    num_blocks: int  # 0 for byte ranges
    nbytes: int
    refusal: str = ""
    # Whole blocks named by index into each side's prepared per-block list (int32), instead
    # of rows (`plan_whole_blocks`); `runs` is how many descriptors they merge into.
    local_indices: np.ndarray | None = None
    remote_indices: np.ndarray | None = None
    runs: int = 0

    @property
    def descriptors(self) -> int:
        return len(self.local_rows) if self.local_indices is None else self.runs


_NO_ROWS = np.zeros((0, 3), dtype=np.uint64)


def plan_blocks(local: PoolInfo, remote: PoolInfo, local_ids: Ints, remote_ids: Ints, *, into_local: bool,
                offset: int = 0, length: int | None = None) -> TransferPlan:
    """Rows for copying blocks `remote_ids[i] <-> local_ids[i]` (bytes [offset, offset +
    length) of each), coalesced into runs. Block ids address the same bytes on both sides
    only when the blocks are the same size: a peer with other blocks is refused."""
    if refusal := _size_refusal(local, remote):
        return refusal
    local_ids, remote_ids, runs = _checked_runs(local, remote, local_ids, remote_ids, into_local=into_local)
    return TransferPlan(
        run_descriptors(local.base_addr, local.block_nbytes, runs.local_starts, runs.counts, local.device_id,
                        offset=offset, length=length),
        run_descriptors(remote.base_addr, remote.block_nbytes, runs.remote_starts, runs.counts, remote.device_id,
                        offset=offset, length=length),
        int(local_ids.size), int(local_ids.size) * (local.block_nbytes if length is None else length))


def plan_whole_blocks(local: PoolInfo, remote: PoolInfo, local_ids: Ints, remote_ids: Ints, *,
                      into_local: bool) -> TransferPlan:
    """`plan_blocks` of whole blocks for an agent with prepared per-block lists: the ids
    checked the same way, as indices (NIXL merges adjacent ones), and no rows built."""
    if refusal := _size_refusal(local, remote):
        return refusal
    local_ids, remote_ids, runs = _checked_runs(local, remote, local_ids, remote_ids, into_local=into_local)
    return TransferPlan(_NO_ROWS, _NO_ROWS, int(local_ids.size), int(local_ids.size) * local.block_nbytes,
                        local_indices=local_ids.astype(np.int32), remote_indices=remote_ids.astype(np.int32),
                        runs=len(runs))


def _size_refusal(local: PoolInfo, remote: PoolInfo) -> TransferPlan | None:
    if local.block_nbytes == remote.block_nbytes:
        return None
    return TransferPlan(_NO_ROWS, _NO_ROWS, 0, 0, refusal=(
        f"the peer's pool has {remote.block_nbytes}-byte blocks, this agent's {local.block_nbytes}-byte "
        "blocks: block ids do not address the same bytes (use byte ranges)"))


def _checked_runs(local: PoolInfo, remote: PoolInfo, local_ids: Ints, remote_ids: Ints, *,
                  into_local: bool) -> tuple[np.ndarray, np.ndarray, BlockRuns]:
    """Both sides' ids as arrays, checked against their pools, and the runs they form."""
    local_ids, remote_ids = as_block_ids(local_ids), as_block_ids(remote_ids)
    if local_ids.size != remote_ids.size:
        raise ValueError(f"{remote_ids.size} remote block ids but {local_ids.size} local block ids")
    runs = _single_run(local_ids, remote_ids)
    if runs is None:
        check_block_ids(local_ids, local.num_blocks, "local", unique=into_local)
        check_block_ids(remote_ids, remote.num_blocks, "remote", unique=not into_local)
        runs = coalesce_block_runs(local_ids, remote_ids)
    else:  # consecutive ids are unique: only the run's ends can be out of range
        _check_run(int(runs.local_starts[0]), local_ids.size, local.num_blocks, "local")
        _check_run(int(runs.remote_starts[0]), local_ids.size, remote.num_blocks, "remote")
    return local_ids, remote_ids, runs


def _single_run(local_ids: np.ndarray, remote_ids: np.ndarray) -> BlockRuns | None:
    """The one run of ids that advance by one on both sides (the common transfer: blocks
    allocated together), found in a few array operations; None for anything else. Planning
    runs right after the previous transfer has flushed the caches, where each array
    operation costs microseconds: the general path's ~20 cost 6% of a 16 MiB read."""
    if not local_ids.size or not ((local_ids[1:] - local_ids[:-1] == 1).all()
                                  and (remote_ids[1:] - remote_ids[:-1] == 1).all()):
        return None
    return BlockRuns(local_ids[:1], remote_ids[:1], np.array([local_ids.size], dtype=np.int64))


def _check_run(first: int, count: int, num_blocks: int, side: str) -> None:
    if first < 0 or first + count > num_blocks:
        raise ValueError(f"{side} block id out of range [0, {num_blocks}): {first if first < 0 else first + count - 1}")


class ByteRanges(NamedTuple):
    """Rows of a byte-range transfer: `lengths[i]` bytes at `local_offsets[i]` in the local
    pool and at `remote_offsets[i]` in the peer's (int64 arrays of one size)."""

    local_offsets: np.ndarray
    remote_offsets: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return int(self.lengths.size)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())


def byte_ranges(local_offsets: Ints, remote_offsets: Ints, lengths: Ints) -> ByteRanges:
    """The rows as int64 arrays; ValueError unless they are of one size with positive lengths."""
    ranges = ByteRanges(*(np.asarray(column, dtype=np.int64).reshape(-1)
                          for column in (local_offsets, remote_offsets, lengths)))
    if not ranges.local_offsets.size == ranges.remote_offsets.size == ranges.lengths.size:
        raise ValueError(f"{ranges.remote_offsets.size} remote offsets, {ranges.local_offsets.size} local "
                         f"offsets and {ranges.lengths.size} lengths")
    if ranges.lengths.size and int(ranges.lengths.min()) <= 0:
        raise ValueError(f"range lengths must be positive: {int(ranges.lengths.min())}")
    return ranges


def check_ranges(offsets: np.ndarray, lengths: np.ndarray, pool_nbytes: int, side: str, *, disjoint: bool) -> None:
    """Raise ValueError for a range outside [0, pool_nbytes), or, where they must not
    (a transfer's destination), for two ranges that overlap."""
    if offsets.size == 0:
        return
    ends = offsets + lengths
    if int(offsets.min()) < 0 or int(ends.max()) > pool_nbytes:
        row = int(np.flatnonzero((offsets < 0) | (ends > pool_nbytes))[0])
        raise ValueError(f"{side} range [{int(offsets[row])}, {int(ends[row])}) is outside the "
                         f"{pool_nbytes}-byte pool")
    if disjoint and offsets.size > 1:
        if not (offsets[1:] >= ends[:-1]).all():  # sorted and apart: the common case, checked cheaply
            order = np.argsort(offsets, kind="stable")
            if not (offsets[order][1:] >= ends[order][:-1]).all():
                raise ValueError(f"{side} ranges overlap")


def coalesce_ranges(ranges: ByteRanges) -> ByteRanges:
    """Merge each row into the one before it where both sides continue it exactly. Order is
    kept, not sorted: the caller's order is its plan, and what it lays out adjacently merges."""
    local, remote, lengths = ranges
    if lengths.size < 2:
        return ranges
    starts = run_starts(local, remote, lengths)
    if starts.size == lengths.size:
        return ranges
    return ByteRanges(local[starts], remote[starts], np.add.reduceat(lengths, starts))


def run_starts(first: np.ndarray, second: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Rows (two offsets and a length, two or more) that begin a run: each later row of a run
    continues the one before it on both sides. Merged, a run is its first row's offsets and
    the sum of its lengths (`np.add.reduceat(lengths, starts)`). Also `connector.range_plan`'s."""
    joins = (first[:-1] + lengths[:-1] == first[1:]) & (second[:-1] + lengths[:-1] == second[1:])
    return np.flatnonzero(np.concatenate(([True], ~joins)))


def range_descriptors(base_addr: int, offsets: np.ndarray, lengths: np.ndarray, device_id: int = 0) -> np.ndarray:
    """Descriptor rows (address, length, device_id), Nx3 uint64, one per range."""
    rows = np.empty((offsets.size, 3), dtype=np.uint64)
    rows[:, 0] = base_addr + offsets
    rows[:, 1] = lengths
    rows[:, 2] = device_id
    return rows


def plan_ranges(local: PoolInfo, remote: PoolInfo, local_offsets: Ints, remote_offsets: Ints, lengths: Ints, *,
                into_local: bool) -> TransferPlan:
    """Rows for copying byte ranges between two pools of any geometry, checked against both
    pools (the destination's ranges must not overlap) and merged where adjacent."""
    ranges = byte_ranges(local_offsets, remote_offsets, lengths)
    check_ranges(ranges.local_offsets, ranges.lengths, local.nbytes, "local", disjoint=into_local)
    check_ranges(ranges.remote_offsets, ranges.lengths, remote.nbytes, "remote", disjoint=not into_local)
    merged = coalesce_ranges(ranges)
    return TransferPlan(range_descriptors(local.base_addr, merged.local_offsets, merged.lengths, local.device_id),
                        range_descriptors(remote.base_addr, merged.remote_offsets, merged.lengths, remote.device_id),
                        0, merged.nbytes)
