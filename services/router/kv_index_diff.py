"""What a worker's snapshot changes in the KV index (`kv_index`), on sorted arrays. Pure.

A resync after a short gap finds a worker's snapshot mostly equal to what the index holds:
of 1M blocks, a few thousand were evicted or added. Finding them with Python sets costs
several passes of random accesses into million-entry hash tables (about a second per
million on a busy host, where those cache misses dominate); sorting u64 arrays and
searching one in the other reads memory in order and costs a fraction of that. The index
then applies only the difference, block by block, as events would.
"""

from __future__ import annotations

import numpy as np

_SPLITMIX = tuple(np.uint64(constant) for constant in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
_SHIFTS = tuple(np.uint64(shift) for shift in (30, 27, 31))


def _pair_keys(engine: np.ndarray, chain: np.ndarray) -> np.ndarray:
    """One u64 per (engine, chain) pair: engine XOR splitmix64(chain). A nonlinear mix, so that
    engine hashes derived from chain hashes by arithmetic (as stand-ins in tests and benches
    are) do not make distinct pairs collide."""
    mixed = chain + _SPLITMIX[0]
    mixed = (mixed ^ (mixed >> _SHIFTS[0])) * _SPLITMIX[1]
    mixed = (mixed ^ (mixed >> _SHIFTS[1])) * _SPLITMIX[2]
    return engine ^ mixed ^ (mixed >> _SHIFTS[2])


def snapshot_diff(known: dict[int, int], engine_hashes: list[int],
                  chain_hashes: list[int]) -> tuple[list[int], list[int], list[int]] | None:
    """How to turn `known` (a worker's engine hash -> chain hash) into the snapshot's mapping
    (`engine_hashes[i]` -> `chain_hashes[i]`). Returns (engine hashes to drop, then the engine
    hashes and chain hashes to add, in snapshot order); an engine hash whose chain hash changed
    is in both. None when a hash is not a u64 or the snapshot repeats an engine hash (the
    caller then applies it event by event).

    Each (engine, chain) pair becomes one u64 key; the keys on either side are sorted (plain
    sorts: an argsort costs 4-5x more), merged (a stable sort of two sorted runs is one merge),
    and the keys found once are the difference. Two distinct pairs share a key with
    probability 2^-64 per comparison: then the old pair would stay.
    """
    try:
        old_engine = np.fromiter(known.keys(), dtype=np.uint64, count=len(known))
        old_chain = np.fromiter(known.values(), dtype=np.uint64, count=len(known))
        new_engine = np.array(engine_hashes, dtype=np.uint64)
        new_chain = np.array(chain_hashes, dtype=np.uint64)
    except (OverflowError, TypeError, ValueError):
        return None
    if new_engine.ndim != 1 or len(new_engine) != len(new_chain):
        return None
    engine_sorted = np.sort(new_engine)
    if np.any(engine_sorted[1:] == engine_sorted[:-1]):
        return None
    old_keys = _pair_keys(old_engine, old_chain)
    new_keys = _pair_keys(new_engine, new_chain)
    old_sorted = np.sort(old_keys)
    merged = np.concatenate((old_sorted, np.sort(new_keys)))
    merged.sort(kind="stable")
    repeated = merged[1:] == merged[:-1]
    once = np.ones(len(merged), dtype=bool)
    once[1:] &= ~repeated
    once[:-1] &= ~repeated
    changed = merged[once]  # sorted: keys on one side only
    was_known = _members(changed, old_sorted)
    dropped = old_engine[_members(old_keys, changed[was_known])]
    added = _members(new_keys, changed[~was_known])
    return dropped.tolist(), new_engine[added].tolist(), new_chain[added].tolist()


def _members(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """Per value: whether it is in `sorted_set`."""
    if not len(sorted_set):
        return np.zeros(len(values), dtype=bool)
    position = np.minimum(np.searchsorted(sorted_set, values), len(sorted_set) - 1)
    return sorted_set[position] == values
