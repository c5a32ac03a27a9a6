"""vLLM KV-event wire decoding and the deduplicating block mirror (pure; no vLLM needed).

When vLLM is installed, its own event classes encode the payloads too, so a change in
vLLM's wire format shows up here.
"""

from __future__ import annotations

import msgspec
import pytest

from services.worker.vllm.kv_event_wire import WireDecoder, block_hash_int
from services.worker.vllm.kv_mirror import HostBlocksRemoved, KvBlockMirror
from shared.block_hash import block_hash_chain, request_chain
from shared.schemas.kv_events import AllBlocksCleared, BlockRemoved, BlocksMoved, BlockStored

BS = 4


def _tokens(first: int, blocks: int) -> list[int]:
    return list(range(first, first + blocks * BS))


def _stored(hashes: list[int], parent: int | None, first_token: int) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent,
                       token_ids=_tokens(first_token, len(hashes)), block_size=BS)


def _passed(hashes: list[int], parent: int | None, first_token: int, chain: list[int] | None) -> BlockStored:
    """A store as the mirror passes it on: with Tandem's chain hashes where it knows them."""
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=_tokens(first_token, len(hashes)),
                       block_size=BS, chain_hashes=chain)


# ---- wire -------------------------------------------------------------------------------

def _wire_stored(hashes, parent, tokens, *, medium="GPU", group_idx=0, **extra):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": medium,
            "lora_name": None, "group_idx": group_idx, **extra}


def test_wire_decodes_vllm_shaped_batch() -> None:
    payload = msgspec.msgpack.encode([
        1.5,
        [
            _wire_stored([11, 12], None, _tokens(0, 2), extra_keys=[None, None], kv_cache_spec_kind="full_attention"),
            {"type": "BlockRemoved", "block_hashes": [b"\x01" * 24 + (7).to_bytes(8, "big")], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
            _wire_stored([13], 12, _tokens(8, 1), medium="CPU"),  # Tandem's host tier
            {"type": "BlockRemoved", "block_hashes": [13], "medium": "CPU"},
            _wire_stored([15], 12, _tokens(8, 1), medium="STORAGE"),  # a tier Tandem does not mirror: skipped
            _wire_stored([14], None, _tokens(0, 1), group_idx=1),  # another KV group: skipped
            {"type": "SomethingNew", "x": 1},  # a future event kind: skipped
        ],
        0,
    ])
    batch = WireDecoder().decode(payload)
    assert batch.ts == 1.5
    assert batch.skipped == 3
    assert batch.events == [
        BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=_tokens(0, 2), block_size=BS),
        BlockRemoved(block_hashes=[7]),  # the low 64 bits of the hash bytes
        AllBlocksCleared(),
        BlockStored(block_hashes=[13], parent_block_hash=12, token_ids=_tokens(8, 1), block_size=BS, tier="host"),
        HostBlocksRemoved(block_hashes=[13]),
    ]


def test_block_hash_int_takes_low_64_bits_of_bytes() -> None:
    assert block_hash_int((5).to_bytes(32, "big")) == 5
    assert block_hash_int(b"\xff" * 32) == (1 << 64) - 1
    assert block_hash_int(42) == 42


def test_wire_matches_vllm_encoder() -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM is not installed in this venv")
    batch = kv_events.KVEventBatch(ts=2.0, events=[
        kv_events.BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=_tokens(0, 2),
                              block_size=BS, lora_id=None, medium="GPU", lora_name=None),
        kv_events.BlockStored(block_hashes=[b"\x00" * 31 + b"\x03"], parent_block_hash=2,
                              token_ids=_tokens(8, 1), block_size=BS, lora_id=None, medium="GPU",
                              lora_name=None),
        kv_events.BlockRemoved(block_hashes=[1], medium="GPU"),
        kv_events.AllBlocksCleared(),
    ], data_parallel_rank=0)
    decoded = WireDecoder().decode(msgspec.msgpack.Encoder().encode(batch))
    assert decoded.skipped == 0
    assert decoded.events == [
        BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=_tokens(0, 2), block_size=BS),
        BlockStored(block_hashes=[3], parent_block_hash=2, token_ids=_tokens(8, 1), block_size=BS),
        BlockRemoved(block_hashes=[1]),
        AllBlocksCleared(),
    ]


# ---- mirror -----------------------------------------------------------------------------

def test_mirror_passes_a_store_once_and_a_removal_at_the_last_copy() -> None:
    mirror = KvBlockMirror(BS)
    first = _stored([1, 2], None, 0)
    assert mirror.apply(first) == [_passed([1, 2], None, 0, block_hash_chain(_tokens(0, 2), BS))]
    assert mirror.apply(_stored([1, 2], None, 0)) == []  # a second physical copy
    assert mirror.cached_blocks == 2
    assert mirror.apply(BlockRemoved(block_hashes=[2])) == []  # one copy of 2 left
    assert mirror.apply(BlockRemoved(block_hashes=[2, 99])) == [BlockRemoved(block_hashes=[2])]
    assert mirror.cached_blocks == 1


def test_mirror_splits_a_store_around_known_blocks() -> None:
    mirror = KvBlockMirror(BS)
    mirror.apply(_stored([2], 1, 4))
    passed = mirror.apply(_stored([1, 2, 3], None, 0))
    # Block 2's parent was never announced, so the chain of 2 and of 3 after it is unknown.
    assert passed == [_passed([1], None, 0, block_hash_chain(_tokens(0, 1), BS)), _passed([3], 2, 8, None)]


def test_mirror_skips_stores_that_do_not_fill_whole_blocks() -> None:
    mirror = KvBlockMirror(BS)
    odd = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2], block_size=2)
    assert mirror.apply(odd) == []
    assert mirror.malformed_events == 1 and mirror.cached_blocks == 0


def test_mirror_snapshot_is_chains_parents_first() -> None:
    mirror = KvBlockMirror(BS)
    mirror.apply(_stored([1, 2, 3], None, 0))
    mirror.apply(_stored([4], 2, 100))  # a branch after block 2
    mirror.apply(_stored([7, 8], 6, 200))  # parent 6 never seen: its own root
    snapshot = mirror.snapshot()
    seen: set[int] = set()
    for event in snapshot:
        assert event.parent_block_hash is None or event.parent_block_hash in seen or event.parent_block_hash == 6
        seen.update(event.block_hashes)
    assert seen == {1, 2, 3, 4, 7, 8}
    chains = {event.block_hashes[0]: event.chain_hashes for event in snapshot}
    assert chains[1] == block_hash_chain(_tokens(0, 3), BS)  # the chain the router would compute
    assert chains[4] == block_hash_chain(_tokens(0, 2) + _tokens(100, 1), BS)[2:]
    assert chains[7] is None  # under a parent never seen
    replay = KvBlockMirror(BS)
    for event in snapshot:
        replay.apply(event)
    assert replay.snapshot() == snapshot
    assert mirror.apply(AllBlocksCleared()) == [AllBlocksCleared()]
    assert mirror.snapshot() == []


# ---- Tandem hashes (a holder answering a lease request) ------------------------------------

def test_prefix_tokens_follow_tandem_chain_hashes() -> None:
    from shared.block_hash import block_hash_chain

    mirror = KvBlockMirror(BS)
    mirror.apply(_stored([1, 2], None, 0))
    mirror.apply(_stored([3], 2, 8))
    tokens = _tokens(0, 3)
    chain = block_hash_chain(tokens, BS)
    assert mirror.prefix_tokens(chain) == tokens
    assert mirror.prefix_blocks(chain) == [1, 2, 3]  # vLLM's own hashes of the same blocks
    assert mirror.prefix_tokens(chain + block_hash_chain(tokens + _tokens(100, 1), BS)[3:]) == tokens
    assert mirror.prefix_tokens(block_hash_chain(_tokens(50, 2), BS)) == []  # another prompt
    mirror.apply(BlockRemoved(block_hashes=[2]))
    assert mirror.prefix_tokens(chain) == _tokens(0, 1)  # the chain breaks where a block left
    assert mirror.prefix_blocks(chain) == [1]
    mirror.apply(AllBlocksCleared())
    assert mirror.prefix_tokens(chain) == []


def test_blocks_whose_parent_was_never_announced_have_no_tandem_hash() -> None:
    from shared.block_hash import block_hash_chain

    mirror = KvBlockMirror(BS)
    mirror.apply(_stored([9], 8, 4))  # parent 8 unknown (events lost before a resync)
    assert mirror.prefix_tokens(block_hash_chain(_tokens(0, 2), BS)) == []


# ---- the host tier (Tandem's connector, medium "CPU") ----------------------------------------

def _host(hashes: list[int], parent: int | None, first_token: int) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=_tokens(first_token, len(hashes)),
                       block_size=BS, tier="host")


def test_a_block_both_tiers_hold_stays_in_the_device_tier_until_vllm_evicts_it() -> None:
    mirror = KvBlockMirror(BS)
    chain = block_hash_chain(_tokens(0, 2), BS)
    assert mirror.apply(_stored([1, 2], None, 0)) == [_passed([1, 2], None, 0, chain)]
    assert mirror.apply(_host([1, 2], None, 0)) == []  # write-through: the device tier is what counts
    assert (mirror.cached_blocks, mirror.host_blocks) == (2, 2)
    assert mirror.apply(BlockRemoved(block_hashes=[2])) == [BlocksMoved(block_hashes=[2], tier="host")]
    assert mirror.cached_blocks == 1
    # loaded back from the host tier: vLLM caches it again
    assert mirror.apply(_stored([2], 1, 4)) == [BlocksMoved(block_hashes=[2], tier="device")]
    assert mirror.apply(BlockRemoved(block_hashes=[1, 2])) == [BlocksMoved(block_hashes=[1, 2], tier="host")]
    assert mirror.apply(HostBlocksRemoved(block_hashes=[2])) == [BlockRemoved(block_hashes=[2])]
    assert mirror.apply(HostBlocksRemoved(block_hashes=[2, 99])) == []  # gone, or never known
    assert (mirror.cached_blocks, mirror.host_blocks) == (0, 1)


def test_a_block_the_host_tier_drops_while_vllm_holds_it_stays() -> None:
    mirror = KvBlockMirror(BS)
    mirror.apply(_stored([1], None, 0))
    mirror.apply(_host([1], None, 0))
    assert mirror.apply(HostBlocksRemoved(block_hashes=[1])) == []
    assert mirror.apply(BlockRemoved(block_hashes=[1])) == [BlockRemoved(block_hashes=[1])]


def test_host_only_blocks_are_announced_in_the_host_tier_with_their_chain() -> None:
    mirror = KvBlockMirror(BS)
    chain = block_hash_chain(_tokens(0, 2), BS)
    mirror.apply(_stored([1], None, 0))
    passed = mirror.apply(_host([2], 1, 4))  # its parent is known (device): the chain goes on
    assert passed == [BlockStored(block_hashes=[2], parent_block_hash=1, token_ids=_tokens(4, 1), block_size=BS,
                                  chain_hashes=chain[1:], tier="host")]
    # a holder pins in vLLM's cache: the lease's prefix ends where the device tier does
    assert mirror.prefix_tokens(chain) == _tokens(0, 1)


def test_snapshot_announces_each_block_in_its_tier() -> None:
    mirror = KvBlockMirror(BS)
    chain = block_hash_chain(_tokens(0, 3), BS)
    mirror.apply(_stored([1, 2, 3], None, 0))
    mirror.apply(_host([1, 2, 3], None, 0))
    mirror.apply(BlockRemoved(block_hashes=[2, 3]))
    assert mirror.snapshot() == [
        _passed([1], None, 0, chain[:1]),
        BlockStored(block_hashes=[2, 3], parent_block_hash=1, token_ids=_tokens(4, 2), block_size=BS,
                    chain_hashes=chain[1:], tier="host"),
    ]


def test_blocks_of_a_prompt_with_images_chain_as_the_router_chains_them() -> None:
    """vLLM's extra keys name each block's images as (identifier, offset); the mirror's chain
    hashes take them in as `shared.block_hash.request_chain` does (the adapter's name among
    the keys is not an image: it is the root's, as the event's `lora_name` says)."""
    tokens = _tokens(0, 3)
    keys = [["lora-a", ["sha256:a", 2]], [["sha256:a", -2]], None]  # an image at tokens 2-6
    payload = msgspec.msgpack.encode([1.0, [_wire_stored([1, 2, 3], None, tokens, extra_keys=keys)
                                            | {"lora_name": "lora-a"}], 0])
    [event] = WireDecoder().decode(payload).events
    [passed] = KvBlockMirror(BS).apply(event)
    assert (passed.adapter, passed.cache_salt) == ("lora-a", "")
    assert passed.chain_hashes == request_chain(tokens, BS, adapter="lora-a", images=[("sha256:a", 2, 5)])
    plain = block_hash_chain(tokens, BS)
    assert all(image != text for image, text in zip(passed.chain_hashes, plain))
