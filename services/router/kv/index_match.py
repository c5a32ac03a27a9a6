"""`KvIndex.match`'s two ways through a chain, both as drop points: (position, mask), the
workers of `mask` holding exactly `position` leading blocks.

- `linear_drop_points`: any holders. The running AND of the holders' masks along the chain is
  computed in C (map, accumulate, takewhile) and stops at the first block no remaining worker
  holds. As bits can only drop out, the masks never grow as integers: each group's drop point
  is found by bisecting the running masks, not by a Python loop per block.
- `drop_points`: holders whose bits are monotone along the chain (closed workers,
  `index_runs`): O(log n) lookups per drop point.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from itertools import accumulate, repeat, takewhile
from operator import and_, neg
from typing import Protocol


class _Named(Protocol):
    worker_id: str


def linear_drop_points(get: Callable[[int, int], int], chain: Sequence[int]) -> list[tuple[int, int]]:
    live = list(takewhile(bool, accumulate(map(get, chain, repeat(0)), and_)))
    points = []
    end = len(live)
    start = 0
    while start < end:
        mask = live[start]
        stop = bisect_right(live, -mask, start, end, key=neg)
        points.append((stop, mask ^ live[stop] if stop < end else mask))
        start = stop
    return points


def drop_points(get: Callable[[int, int], int], chain: Sequence[int], first: int) -> list[tuple[int, int]]:
    """Drop points of the workers of `first` (the holders of chain[0], all closed), by
    bisection: between two probes whose masks agree, no worker drops out (monotone)."""
    last_position = len(chain) - 1
    last = get(chain[last_position], 0) & first if last_position else first
    points = [(last_position + 1, last)] if last else []
    stack = [(0, first, last_position, last)] if last != first else []
    while stack:
        low, low_mask, high, high_mask = stack.pop()
        if high - low == 1:
            points.append((high, low_mask ^ high_mask))
            continue
        middle = (low + high) // 2
        mask = get(chain[middle], 0) & low_mask
        if mask != low_mask:
            stack.append((low, low_mask, middle, mask))
        if mask != high_mask:
            stack.append((middle, mask, high, high_mask))
    points.sort()
    return points


def overlaps_of(points: list[tuple[int, int]], by_slot: Sequence[_Named | None]) -> dict[str, int]:
    overlaps: dict[str, int] = {}
    for stop, dropped in points:
        while dropped:
            low = dropped & -dropped
            worker = by_slot[low.bit_length() - 1]
            assert worker is not None, "index invariant: a set bit has a worker"
            overlaps[worker.worker_id] = stop
            dropped ^= low
    return overlaps
