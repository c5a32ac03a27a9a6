"""The vLLM connector's host tier policy (`connector.vllm.host_slots.HostSlots`): which slot
holds which block hash, least recently used reused first. Pure; no vLLM needed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from connector.vllm.host_slots import HostSlots


def test_blocks_take_free_slots_then_the_least_recently_used_one() -> None:
    slots = HostSlots(2)
    assert slots.store(b"a") == (0, None)
    assert slots.store(b"b") == (1, None)
    assert slots.store(b"a") is None  # held already: now the most recent
    assert slots.store(b"c") == (1, b"b")  # b was the least recently used
    assert b"b" not in slots and len(slots) == 2


def test_a_run_counts_held_blocks_from_its_start_to_the_first_missing_one() -> None:
    slots = HostSlots(4)
    for block_hash in (b"a", b"b", b"d"):
        slots.store(block_hash)
    hashes = [b"a", b"b", b"c", b"d"]
    assert slots.run(hashes, 0) == 2
    assert slots.run(hashes, 2) == 0
    assert slots.run(hashes, 3) == 1
    assert slots.run(hashes, 4) == 0


def test_blocks_taken_for_a_load_become_the_most_recent() -> None:
    slots = HostSlots(2)
    slots.store(b"a")
    slots.store(b"b")
    assert slots.take([b"a"]) == [0]
    assert slots.store(b"c") == (1, b"b")  # not a: the load made it recent


def test_an_empty_tier_is_refused() -> None:
    with pytest.raises(AssertionError):
        HostSlots(0)


@given(st.integers(min_value=1, max_value=8), st.lists(st.integers(min_value=0, max_value=20), max_size=200))
def test_each_held_block_has_its_own_slot_within_capacity(capacity: int, stores: list[int]) -> None:
    slots = HostSlots(capacity)
    owner: dict[int, int] = {}  # slot -> block hash, as the policy said
    for block_hash in stores:
        placed = slots.store(block_hash)
        if placed is None:
            assert block_hash in slots
            continue
        slot, evicted = placed
        assert 0 <= slot < capacity
        assert owner.get(slot) == evicted  # a slot is handed over by its last owner only
        owner[slot] = block_hash
    assert len(slots) == len(owner) == len(set(owner.values())) <= capacity
    assert all(block_hash in slots for block_hash in owner.values())
