"""What a worker's snapshot changes in the KV index (`index`), on sorted arrays. Pure.

A resync after a short gap finds a worker's snapshot mostly equal to what the index holds:
of 1M blocks, a few thousand were evicted or added. Finding them with Python sets costs
several passes of random accesses into million-entry hash tables (about a second per
million on a busy host, where those cache misses dominate); sorting u64 arrays and
merging them reads memory in order and costs a fraction of that. The index then applies
only the difference, block by block, as events would.
"""

from __future__ import annotations

from itertools import chain

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


def snapshot_diff(known: dict[int, int], engine_runs: list[list[int]],
                  chain_runs: list[list[int]]) -> tuple[list[int], list[int], list[int]] | None:
    """How to turn `known` (a worker's engine hash -> chain hash) into the snapshot's mapping
    (`engine_runs[i][j]` -> `chain_runs[i][j]`: one run per event). Returns (engine hashes to
    drop, then the engine hashes and chain hashes to add, in snapshot order); an engine hash
    whose chain hash changed is in both. None when a hash is not a u64 or the snapshot repeats
    an engine hash (the caller then applies it event by event).

    Engine hashes on either side are sorted (plain sorts: an argsort costs 4-5x more) and
    merged (a stable sort of two sorted runs is one merge): those found once were dropped or
    added. The chain hashes of the added ones come from the few runs that hold them. That
    every engine hash on both sides kept its chain hash is checked with sums of per-pair keys;
    if not, the pairs themselves are diffed (`_pair_diff`). Distinct pairs share a key, or
    sums collide, with probability 2^-64.
    """
    try:
        old_engine = np.fromiter(known.keys(), dtype=np.uint64, count=len(known))
        old_chain = np.fromiter(known.values(), dtype=np.uint64, count=len(known))
        new_engine = np.fromiter(chain.from_iterable(engine_runs), dtype=np.uint64)
        new_chain = np.fromiter(chain.from_iterable(chain_runs), dtype=np.uint64)
    except (OverflowError, TypeError, ValueError):
        return None
    if len(new_engine) != len(new_chain):
        return None
    new_sorted = np.sort(new_engine)
    if np.any(new_sorted[1:] == new_sorted[:-1]):
        return None
    old_sorted = np.sort(old_engine)
    once = _once(old_sorted, new_sorted)
    was_known = _members(once, old_sorted)
    dropped = once[was_known].tolist()
    added = set(once[~was_known].tolist())
    added_engine: list[int] = []
    added_chain: list[int] = []
    if added:
        for engines, chains in zip(engine_runs, chain_runs):
            if not added.isdisjoint(engines):
                for engine_hash, chain_hash in zip(engines, chains):
                    if engine_hash in added:
                        added_engine.append(engine_hash)
                        added_chain.append(chain_hash)
    kept_old = _key_sum(old_engine, old_chain) - _key_sum(dropped, [known[engine_hash] for engine_hash in dropped])
    kept_new = _key_sum(new_engine, new_chain) - _key_sum(added_engine, added_chain)
    if kept_old % 2**64 != kept_new % 2**64:  # an engine hash on both sides changed its chain hash
        return _pair_diff(old_engine, old_chain, new_engine, new_chain)
    return dropped, added_engine, added_chain


def _key_sum(engine: np.ndarray | list[int], chain: np.ndarray | list[int]) -> int:
    """The sum of the pairs' keys, mod 2^64 (numpy's u64 sum wraps)."""
    if not len(engine):
        return 0
    return int(_pair_keys(np.asarray(engine, dtype=np.uint64), np.asarray(chain, dtype=np.uint64)).sum())


def _once(left_sorted: np.ndarray, right_sorted: np.ndarray) -> np.ndarray:
    """The values found once in the two sorted arrays (each without repeats), sorted."""
    merged = np.concatenate((left_sorted, right_sorted))
    merged.sort(kind="stable")
    repeated = merged[1:] == merged[:-1]
    once = np.ones(len(merged), dtype=bool)
    once[1:] &= ~repeated
    once[:-1] &= ~repeated
    return merged[once]


def _pair_diff(old_engine: np.ndarray, old_chain: np.ndarray, new_engine: np.ndarray,
               new_chain: np.ndarray) -> tuple[list[int], list[int], list[int]]:
    """`snapshot_diff` on (engine, chain) pairs, one u64 key each: the pairs found once."""
    old_keys = _pair_keys(old_engine, old_chain)
    new_keys = _pair_keys(new_engine, new_chain)
    old_sorted = np.sort(old_keys)
    changed = _once(old_sorted, np.sort(new_keys))
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
