"""KV events of blocks that hold an image's placeholder tokens, from vLLM's wire (extra keys)
through the worker's mirror to a router that hashes or verifies chains itself
(`--verify-kv-hashes`): the events carry each block's image salts, so the router's chain is
the salted one the request path computes, and no block is counted as mismatched."""

from __future__ import annotations

import msgspec

from services.router.kv.index import KvIndex
from services.worker.vllm.kv_event_wire import WireDecoder
from services.worker.vllm.kv_mirror import KvBlockMirror
from shared.block_hash import image_block_salts, packed_block_hash_chain, request_chain
from shared.schemas.kv_events import AllBlocksCleared, BlockStored, KvEventBatch, for_wire
from shared.token_pack import pack_token_ids
from tests.unit.test_kv_index import tokens

BS = 4
IMAGE = ("sha256-of-image-a", 6, 8)  # identifier, first placeholder token, placeholder tokens
PROMPT = tokens(7, 5 * BS)
CHAIN = request_chain(PROMPT, BS, images=[IMAGE])


def through_mirror(block_hashes: list[int], token_ids: list[int], extra_keys: list, *, block_size: int = BS,
                   lora_name: str | None = None) -> tuple[KvBlockMirror, BlockStored]:
    """vLLM's store event of a chain's first blocks, as vLLM's wire carries it, and as the
    worker's mirror passes it on."""
    payload = msgspec.msgpack.encode([0.0, [
        {"type": "BlockStored", "block_hashes": block_hashes, "parent_block_hash": None, "token_ids": token_ids,
         "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": lora_name,
         "extra_keys": extra_keys}], 0])
    [wire_event] = WireDecoder().decode(payload).events
    mirror = KvBlockMirror(block_size)
    [passed] = mirror.apply(wire_event)
    assert isinstance(passed, BlockStored)
    return mirror, passed


def mirrored_event() -> tuple[KvBlockMirror, BlockStored]:
    """The prompt's 5 blocks, their extra keys naming the image in blocks 1-3 at offsets 2, -2, -6."""
    return through_mirror([31, 32, 33, 34, 35], PROMPT, [None, [[IMAGE[0], 2]], [[IMAGE[0], -2]], [[IMAGE[0], -6]], None])


def verifying_index() -> KvIndex:
    index = KvIndex(verify_hashes=True)
    index.add_worker("w", BS)
    return index


def batch(seq: int, *events) -> KvEventBatch:
    return KvEventBatch(worker_id="w", seq=seq, ts=0.0, events=for_wire(events))


def test_the_mirror_passes_on_each_blocks_image_salts_with_the_salted_chain() -> None:
    _, passed = mirrored_event()
    assert passed.chain_hashes == CHAIN
    assert passed.image_salts == image_block_salts([IMAGE], BS, 5)
    assert passed.image_salts[0] == passed.image_salts[4] == b""  # blocks without image tokens


def test_a_verifying_router_finds_no_mismatch_in_image_blocks() -> None:
    _, passed = mirrored_event()
    index = verifying_index()
    result = index.ingest(msgspec.msgpack.decode(msgspec.msgpack.encode(batch(1, passed)), type=KvEventBatch))
    assert (result.stored_blocks, result.mismatched_blocks) == (5, 0)
    assert index.match(CHAIN) == {"w": 5}


def test_without_the_salts_verification_would_refute_the_image_blocks() -> None:
    """What the router counted before events carried the salts: every block from the image's first on."""
    _, passed = mirrored_event()
    passed.image_salts = None
    result = verifying_index().ingest(batch(1, passed))
    assert result.mismatched_blocks == 4


def test_a_snapshot_carries_the_salts_too() -> None:
    mirror, _ = mirrored_event()
    snapshot = mirror.snapshot()
    assert [event.image_salts for event in snapshot] == [image_block_salts([IMAGE], BS, 5)]
    index = verifying_index()
    result = index.ingest(batch(1, AllBlocksCleared(), *snapshot))
    assert (result.stored_blocks, result.mismatched_blocks) == (5, 0)


def test_a_router_hashing_an_event_without_chain_salts_the_image_blocks() -> None:
    _, passed = mirrored_event()
    passed.chain_hashes = None  # a publisher that could not compute the chain
    index = KvIndex()
    index.add_worker("w", BS)
    assert index.ingest(batch(1, passed)).stored_blocks == 5
    assert index.match(CHAIN) == {"w": 5}
    assert index.match(request_chain(PROMPT, BS, images=[("another-image", 6, 8)])) == {"w": 1}  # the text before it


def test_the_packed_chain_with_block_salts_is_the_request_chain() -> None:
    salts = image_block_salts([IMAGE], BS, 5)
    assert packed_block_hash_chain(pack_token_ids(PROMPT), BS, block_salts=salts) == CHAIN
