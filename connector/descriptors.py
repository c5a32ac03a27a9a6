"""Pure descriptor planning for KV block transfers: block ids in, NIXL descriptor rows out.

A KV pool is one registered region of `num_blocks` blocks, each `block_nbytes` long, block
`b` at `base + b * block_nbytes`. A transfer pairs local with remote block ids. Pairs whose
ids both advance by one are one contiguous byte range on each side, so they travel as one
larger descriptor: fewer descriptors is what lets a transfer of adjacent blocks run at
memory bandwidth instead of per-descriptor overhead.

`KvAgent` (connector/nixl_agent.py) is the only caller. Nothing here does I/O or touches
NIXL; a descriptor row is `(address, length, device_id)` as NIXL's `nixlXferDList` takes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


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


def as_block_ids(block_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.asarray(block_ids, dtype=np.int64).reshape(-1)


def coalesce_block_runs(local_ids: Sequence[int] | np.ndarray,
                        remote_ids: Sequence[int] | np.ndarray) -> BlockRuns:
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
