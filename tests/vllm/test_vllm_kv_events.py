"""The KV-event bridge against vLLM's own ZMQ publisher (no engine): live events,
a gap recovered by replay, and a gap the replay buffer cannot cover."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator

import pytest

kv_events = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM is not installed in this venv")

from services.worker.vllm.kv_events import KvEventBridge, KvEventEndpoints  # noqa: E402
from shared.schemas.kv_events import AllBlocksCleared, BlockStored  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

BS = 4


@pytest.fixture
def endpoints() -> Iterator[KvEventEndpoints]:
    with tempfile.TemporaryDirectory(prefix="tandem-kvt-") as directory:
        yield KvEventEndpoints.in_directory(directory)


def _publisher(endpoints: KvEventEndpoints, buffer_steps: int = 100):
    return kv_events.ZmqEventPublisher(0, endpoint=endpoints.publish, replay_endpoint=endpoints.replay,
                                       buffer_steps=buffer_steps)


def _batch(block_hash: int):
    """One stored block chained to the previous hash (block 1 opens the chain)."""
    parent = block_hash - 1 if block_hash > 1 else None
    event = kv_events.BlockStored(block_hashes=[block_hash], parent_block_hash=parent,
                                  token_ids=[block_hash] * BS, block_size=BS, lora_id=None,
                                  medium="GPU", lora_name=None)
    return kv_events.KVEventBatch(ts=time.time(), events=[event])


async def _publish_until_received(publisher, bridge: KvEventBridge, first_hash: int) -> int:
    """Publish chained batches until the bridge has heard one (a SUB socket joins late) and
    then caught up with all of them; returns the next block hash."""
    next_hash = [first_hash]

    def publish_one_more() -> bool:
        if bridge.counters.batches:
            return True
        block_hash = next_hash[0]
        publisher.publish(_batch(block_hash))
        next_hash[0] += 1
        return False

    await wait_for(publish_one_more, 10, "the bridge to hear a batch", interval_s=0.05)
    await _all_received(bridge, next_hash[0] - 1)
    return next_hash[0]


async def _all_received(bridge: KvEventBridge, last_hash: int) -> None:
    await wait_for(lambda: bridge.next_seq == last_hash, 10, f"the bridge to reach batch {last_hash}")


async def _buffered_for_replay(publisher, batches: int) -> None:
    """The publisher's thread (it sends from a queue) has sent the first `batches` batches
    and kept them in its replay buffer (sequence numbers count from 0)."""
    await wait_for(lambda: bool(publisher._buffer) and publisher._buffer[-1][0] == batches - 1, 10,
                   f"{batches} batches in the publisher's replay buffer")


async def _published_unheard(publisher, batches: int) -> None:
    """Blocks 1 to `batches` published while nobody listens: lost on PUB, kept for replay."""
    for block_hash in range(1, batches + 1):
        publisher.publish(_batch(block_hash))
    await _buffered_for_replay(publisher, batches)


async def test_live_events_pass_through(endpoints: KvEventEndpoints) -> None:
    publisher = _publisher(endpoints)
    bridge = KvEventBridge(endpoints, block_size=BS)
    await bridge.start()
    try:
        next_hash = await _publish_until_received(publisher, bridge, 1)
        stored = [event for event in bridge.take_events() if isinstance(event, BlockStored)]
        # Batches sent before the subscription took hold are replayed: nothing is missing.
        assert [event.block_hashes[0] for event in stored] == list(range(1, next_hash))
        assert bridge.counters.unrecoverable_gaps == 0
        assert bridge.cached_blocks == next_hash - 1
    finally:
        await bridge.stop()
        publisher.shutdown()


async def test_gap_is_recovered_from_the_replay_buffer(endpoints: KvEventEndpoints) -> None:
    publisher = _publisher(endpoints)
    await _published_unheard(publisher, 5)
    bridge = KvEventBridge(endpoints, block_size=BS)
    await bridge.start()
    try:
        next_hash = await _publish_until_received(publisher, bridge, 6)
        assert bridge.counters.gaps >= 1 and bridge.counters.unrecoverable_gaps == 0
        assert bridge.counters.replayed_batches >= 5
        events = bridge.take_events()
        assert not any(isinstance(event, AllBlocksCleared) for event in events)
        assert [event.block_hashes[0] for event in events] == list(range(1, next_hash))
    finally:
        await bridge.stop()
        publisher.shutdown()


async def test_gap_beyond_the_replay_buffer_clears_and_continues(endpoints: KvEventEndpoints) -> None:
    publisher = _publisher(endpoints, buffer_steps=2)
    await _published_unheard(publisher, 5)
    bridge = KvEventBridge(endpoints, block_size=BS)
    await bridge.start()
    try:
        next_hash = await _publish_until_received(publisher, bridge, 6)
        assert bridge.counters.unrecoverable_gaps == 1
        events = bridge.take_events()
        assert isinstance(events[0], AllBlocksCleared)
        stored = [event.block_hashes[0] for event in events[1:]]
        # What follows the clear is what arrived after the gap, in order, without repeats.
        assert stored == sorted(set(stored)) and stored[-1] == next_hash - 1
        assert bridge.cached_blocks == len(stored)
    finally:
        await bridge.stop()
        publisher.shutdown()
