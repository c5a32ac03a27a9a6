"""Token ids packed on the wire (`shared.token_pack`, `kv_events.for_wire`): the packing's
round trip and byte layout, malformed input refused plainly, packed events indexed as the
unpacked ones are (hashed, verified, rejected), cut by `split_events`, and read by a consumer
from before packing as events sent without token ids."""

from __future__ import annotations

import msgspec
import pytest

from services.router.kv.batch_decode import KvBatchDecoder
from services.router.kv.index import block_hashes_for
from shared.block_hash import block_hash_chain, packed_block_hash_chain
from shared.codec import Codec, encode
from shared.kv_event_batches import encoded_size, split_events
from shared.schemas.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    for_wire,
    packed_token_ids_of,
    token_ids_of,
)
from shared.token_pack import pack_token_ids, token_array, unpack_token_ids
from tests.unit.kv_schema_history import FirstBlockStored
from tests.unit.test_kv_batch_decode import index_state, random_stream, router_index
from tests.unit.test_kv_index import BLOCK, FakeEngine, tokens

SUBJECT = "kv.events.a"


def wire_batch(batch: KvEventBatch) -> KvEventBatch:
    return msgspec.structs.replace(batch, events=for_wire(batch.events))


# ---- packing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("token_ids", [[], [0], [1, 2, 3], [2**32 - 1, 0, 151_936], list(range(1000))])
def test_token_ids_round_trip_through_packing(token_ids: list[int]) -> None:
    packed = pack_token_ids(token_ids)
    assert len(packed) == 4 * len(token_ids)
    assert unpack_token_ids(packed) == token_ids
    assert token_array(memoryview(packed)).tolist() == token_ids


def test_packed_token_ids_are_little_endian_u32() -> None:
    assert pack_token_ids([1, 0x01020304]) == b"\x01\x00\x00\x00\x04\x03\x02\x01"


@pytest.mark.parametrize("token_id", [-1, 2**32])
def test_a_token_id_outside_u32_is_refused(token_id: int) -> None:
    with pytest.raises(OverflowError):
        pack_token_ids([5, token_id])


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7])
def test_packed_token_ids_of_a_length_not_a_multiple_of_4_are_refused(size: int) -> None:
    with pytest.raises(ValueError, match="not a multiple of 4"):
        unpack_token_ids(b"\x01" * size)


def test_the_packed_chain_is_the_chain() -> None:
    token_ids = tokens(3, 5 * BLOCK + 2)
    for salt, parent in ((b"", 0), (b"salt", 99)):
        assert packed_block_hash_chain(pack_token_ids(token_ids), BLOCK, parent_hash=parent, salt=salt) == \
            block_hash_chain(token_ids, BLOCK, parent_hash=parent, salt=salt)


# ---- events on the wire ----------------------------------------------------------------------


def test_for_wire_packs_the_token_ids_of_stored_events_only() -> None:
    engine = FakeEngine("a", chain_hashes=True)
    stored = engine.stored(tokens(1, 3 * BLOCK))
    removed, cleared = BlockRemoved(block_hashes=[7]), AllBlocksCleared()
    sent = for_wire([cleared, stored, removed, BlockStored(block_hashes=[], parent_block_hash=None, block_size=BLOCK)])
    assert sent[0] is cleared and sent[2] is removed
    assert sent[1].token_ids == [] and sent[1].packed_token_ids == pack_token_ids(stored.token_ids)
    assert msgspec.structs.replace(sent[1], token_ids=stored.token_ids, packed_token_ids=b"") == stored
    assert sent[3].packed_token_ids == b""  # nothing to pack
    assert for_wire(sent) == sent  # packing twice changes nothing
    assert packed_token_ids_of(sent[1]) == packed_token_ids_of(stored) == pack_token_ids(stored.token_ids)


def test_a_packed_batch_decodes_in_full_with_its_token_ids() -> None:
    engine = FakeEngine("a", chain_hashes=True)
    batch = wire_batch(engine.batch(engine.stored(tokens(1, 4 * BLOCK)), BlockRemoved(block_hashes=[3])))
    decoded = Codec(KvEventBatch).decode(encode(batch))
    assert decoded == batch
    assert unpack_token_ids(decoded.events[0].packed_token_ids) == tokens(1, 4 * BLOCK)


def test_packed_is_smaller_on_the_wire() -> None:
    engine = FakeEngine("a", chain_hashes=True)
    batch = engine.batch(engine.stored([100_000 + token for token in tokens(1, 32 * BLOCK)]))
    assert len(encode(wire_batch(batch))) < len(encode(batch))


def test_a_large_packed_event_is_cut_with_its_token_ids_and_adapter() -> None:
    engine = FakeEngine("a", chain_hashes=True)
    event = msgspec.structs.replace(for_wire([engine.stored(tokens(6, 300 * BLOCK))])[0], adapter="lora-1")
    budget = encoded_size(event) // 5
    pieces = [piece for part in split_events([event], budget) for piece in part]
    assert len(pieces) >= 5 and all(isinstance(piece, BlockStored) for piece in pieces)
    assert b"".join(piece.packed_token_ids for piece in pieces) == event.packed_token_ids
    assert all(len(piece.packed_token_ids) == 4 * BLOCK * len(piece.block_hashes) for piece in pieces)
    assert {piece.adapter for piece in pieces} == {"lora-1"}


def test_a_consumer_from_before_packing_reads_packed_events_as_sent_without_token_ids() -> None:
    engine = FakeEngine("a", chain_hashes=True)
    stored = engine.stored(tokens(1, 3 * BLOCK))
    old = msgspec.msgpack.decode(encode(for_wire([stored])[0]), type=FirstBlockStored)
    assert (old.block_hashes, old.chain_hashes, old.token_ids) == (stored.block_hashes, stored.chain_hashes, [])


# ---- the router's index ------------------------------------------------------------------------


@pytest.mark.parametrize("chain_hashes", [False, True])
@pytest.mark.parametrize("verify_hashes", [False, True])
def test_packed_batches_leave_the_index_as_unpacked_ones(chain_hashes: bool, verify_hashes: bool) -> None:
    engines = [FakeEngine(f"w{number}", chain_hashes=chain_hashes) for number in range(4)]
    packed, unpacked = (router_index(*engines, verify_hashes=verify_hashes) for _ in range(2))
    decoder = KvBatchDecoder(verify_hashes=verify_hashes)
    for batch in random_stream(11, engines):
        from_packed = decoder.decode_or_none(encode(wire_batch(batch)), SUBJECT)
        from_unpacked = decoder.decode_or_none(encode(batch), SUBJECT)
        assert from_packed is not None and from_unpacked is not None
        assert packed.ingest(from_packed) == unpacked.ingest(from_unpacked)
    assert index_state(packed) == index_state(unpacked)
    assert sum(index_state(packed)[2].blocks_per_worker.values()) > 0
    assert decoder.malformed.total == 0


def test_packed_token_ids_are_hashed_when_no_chain_is_sent() -> None:
    engine = FakeEngine("a")
    prompt = tokens(4, 5 * BLOCK)
    index = router_index(engine)
    batch = KvBatchDecoder().decode_or_none(encode(wire_batch(engine.batch(engine.stored(prompt)))), SUBJECT)
    assert batch is not None and index.ingest(batch).stored_blocks == 5
    assert index.match(block_hashes_for(prompt, BLOCK)) == {"a": 5}


@pytest.mark.parametrize("packed", [b"\x01\x02\x03", pack_token_ids(range(3 * BLOCK - 1)), b""])
def test_packed_token_ids_that_do_not_fit_are_rejected(packed: bytes) -> None:
    engine = FakeEngine("a")
    event = msgspec.structs.replace(engine.stored(tokens(4, 3 * BLOCK)), token_ids=[], packed_token_ids=packed)
    index = router_index(engine)
    batch = KvBatchDecoder().decode_or_none(encode(engine.batch(event)), SUBJECT)
    assert batch is not None
    result = index.ingest(batch)
    assert (result.stored_blocks, result.rejected_blocks) == (0, 3)


def test_unpacked_token_ids_outside_u32_are_rejected_not_raised() -> None:
    engine = FakeEngine("a")
    event = engine.stored(tokens(4, 2 * BLOCK))
    event.token_ids[3] = 2**40
    index = router_index(engine)
    assert index.ingest(engine.batch(event)).rejected_blocks == 2


def test_verification_reads_packed_token_ids() -> None:
    engine = FakeEngine("a", chain_hashes=True)
    stored = engine.stored(tokens(5, 4 * BLOCK))
    assert stored.chain_hashes is not None
    stored.chain_hashes[2] ^= 1
    index = router_index(engine, verify_hashes=True)
    batch = KvBatchDecoder(verify_hashes=True).decode_or_none(encode(wire_batch(engine.batch(stored))), SUBJECT)
    assert batch is not None
    assert index.ingest(batch).mismatched_blocks == 1


def test_token_ids_of_reads_either_form() -> None:
    ids = [5, 6, 7, 8] * 4
    sent = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=ids, block_size=16)
    assert token_ids_of(sent) == ids
    assert token_ids_of(for_wire([sent])[0]) == ids
