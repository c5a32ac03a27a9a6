"""`shared.kv_event_batches.split_events` on plain data: parts under the budget, in order,
large events cut by blocks with their parent links, nothing lost."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.kv_event_batches import encoded_size, split_events
from shared.schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

BLOCK = 4


def stored(first: int, blocks: int, parent: int | None, chain: bool = True) -> BlockStored:
    hashes = list(range(first, first + blocks))
    return BlockStored(block_hashes=hashes, parent_block_hash=parent,
                       token_ids=[h % 50_000 + 300 for h in hashes for _ in range(BLOCK)], block_size=BLOCK,
                       chain_hashes=[h * 7 + 1 for h in hashes] if chain else None)


def test_events_that_fit_stay_whole_in_one_part() -> None:
    events = [AllBlocksCleared(), stored(1, 3, None), BlockRemoved(block_hashes=[9])]
    assert split_events(events, 10_000) == [events]
    assert split_events([], 10_000) == []
    with pytest.raises(ValueError):
        split_events(events, 0)


def test_a_large_stored_event_is_cut_by_blocks_with_its_chain_intact() -> None:
    event = stored(100, 500, parent=42)
    budget = encoded_size(event) // 7
    parts = split_events([AllBlocksCleared(), event], budget)
    assert len(parts) >= 7
    assert all(sum(map(encoded_size, part)) <= budget for part in parts)
    pieces = [piece for part in parts for piece in part]
    assert isinstance(pieces[0], AllBlocksCleared)
    cut = [piece for piece in pieces if isinstance(piece, BlockStored)]
    assert [h for piece in cut for h in piece.block_hashes] == event.block_hashes
    assert [t for piece in cut for t in piece.token_ids] == event.token_ids
    assert [h for piece in cut for h in piece.chain_hashes or ()] == event.chain_hashes
    assert cut[0].parent_block_hash == 42
    for before, after in zip(cut, cut[1:]):
        assert after.parent_block_hash == before.block_hashes[-1]


def test_a_cut_keeps_each_blocks_image_salt_and_the_roots_cache_salt_on_the_first_part() -> None:
    event = stored(1, 300, parent=None)
    event.image_salts = [bytes([block % 5]) * (block % 3) for block in range(300)]
    event.cache_salt, event.adapter = "tenant-a", "lora-1"
    cut = [piece for part in split_events([event], encoded_size(event) // 5) for piece in part]
    assert len(cut) >= 5 and all(isinstance(piece, BlockStored) for piece in cut)
    assert [salt for piece in cut for salt in piece.image_salts or ()] == event.image_salts
    assert [piece.cache_salt for piece in cut] == ["tenant-a"] + [""] * (len(cut) - 1)
    assert {piece.adapter for piece in cut} == {"lora-1"}


def test_removals_are_cut_too_and_a_lone_block_over_budget_still_goes() -> None:
    removed = BlockRemoved(block_hashes=list(range(10**12, 10**12 + 300)))
    parts = split_events([removed], encoded_size(removed) // 3)
    assert [h for part in parts for event in part for h in event.block_hashes] == removed.block_hashes
    one = stored(1, 1, None)
    assert split_events([one], 8) == [[one]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["stored", "removed", "cleared"]), st.integers(1, 60)), max_size=12),
       st.integers(40, 3000))
def test_any_events_come_back_in_order_under_any_budget(kinds: list[tuple[str, int]], budget: int) -> None:
    events = []
    for index, (kind, blocks) in enumerate(kinds):
        if kind == "stored":
            events.append(stored(index * 1000, blocks, None, chain=index % 2 == 0))
        elif kind == "removed":
            events.append(BlockRemoved(block_hashes=list(range(index * 1000, index * 1000 + blocks))))
        else:
            events.append(AllBlocksCleared())
    parts = split_events(events, budget)
    flat = [event for part in parts for event in part]
    assert all(part for part in parts)
    for part in parts:  # over budget only as a part of one indivisible piece
        assert sum(map(encoded_size, part)) <= budget or len(part) == 1

    def blocks_of(kind: type) -> list[int]:
        return [h for event in flat if isinstance(event, kind) for h in event.block_hashes]

    assert blocks_of(BlockStored) == [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert blocks_of(BlockRemoved) == [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sum(isinstance(e, AllBlocksCleared) for e in flat) == sum(isinstance(e, AllBlocksCleared) for e in events)
