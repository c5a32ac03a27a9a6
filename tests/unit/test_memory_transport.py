"""The in-memory KV transport: copies between registered pools, layer writes, peers that are
unknown, gone or restarted, timeouts, fault injection around it. No NIXL, no NATS."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from connector.faults import FaultInjectingTransport, write_faults
from connector.memory_transport import MemoryFabric, MemoryTransport, default_fabric
from shared.config import KvFaultConfig

BLOCKS, LAYERS, LAYER_NBYTES = 32, 4, 64
BLOCK_NBYTES = LAYERS * LAYER_NBYTES


def pool(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, BLOCKS * BLOCK_NBYTES, dtype=np.uint8)


def blocks(buffer: np.ndarray) -> np.ndarray:
    return buffer.reshape(BLOCKS, BLOCK_NBYTES)


def agent(fabric: MemoryFabric, name: str, seed: int) -> tuple[MemoryTransport, np.ndarray]:
    buffer = pool(seed)
    return MemoryTransport(name, buffer, BLOCK_NBYTES, LAYER_NBYTES, fabric=fabric), buffer


def pair(fabric: MemoryFabric) -> tuple[MemoryTransport, np.ndarray, MemoryTransport, np.ndarray]:
    reader, reader_pool = agent(fabric, "reader", 1)
    holder, holder_pool = agent(fabric, "holder", 2)
    reader.add_peer(holder.agent_name, holder.metadata())
    holder.add_peer(reader.agent_name, reader.metadata())
    return reader, reader_pool, holder, holder_pool


async def test_read_copies_the_peers_blocks() -> None:
    reader, reader_pool, holder, holder_pool = pair(MemoryFabric())
    expected = blocks(holder_pool)[[3, 4, 9]].copy()
    untouched = blocks(reader_pool)[0].copy()
    result = await reader.read("holder", [3, 4, 9], [10, 11, 2], timeout_s=1.0)
    assert result.outcome == "done" and result.ok == [True] * 3 and result.nbytes == 3 * BLOCK_NBYTES
    assert np.array_equal(blocks(reader_pool)[[10, 11, 2]], expected)
    assert np.array_equal(blocks(reader_pool)[0], untouched)
    reader.close()
    holder.close()


async def test_write_of_one_layer_touches_only_that_layer() -> None:
    writer, writer_pool, receiver, receiver_pool = pair(MemoryFabric())
    before = blocks(receiver_pool)[[5, 6]].copy()
    result = await writer.write("holder", [1, 2], [5, 6], timeout_s=1.0, layer=2)
    assert result.outcome == "done" and result.nbytes == 2 * LAYER_NBYTES
    layer = slice(2 * LAYER_NBYTES, 3 * LAYER_NBYTES)
    after = blocks(receiver_pool)[[5, 6]]
    assert np.array_equal(after[:, layer], blocks(writer_pool)[[1, 2]][:, layer])
    outside = np.ones(BLOCK_NBYTES, dtype=bool)
    outside[layer] = False
    assert np.array_equal(after[:, outside], before[:, outside])
    whole = await writer.write("holder", [7], [8], timeout_s=1.0)
    assert whole.outcome == "done" and np.array_equal(blocks(receiver_pool)[8], blocks(writer_pool)[7])
    writer.close()
    receiver.close()


async def test_unknown_gone_and_restarted_peers_are_failed_results() -> None:
    fabric = MemoryFabric()
    reader, _, holder, _ = pair(fabric)
    unknown = await reader.read("nobody", [1], [1], timeout_s=1.0)
    assert unknown.outcome == "failed" and unknown.ok == [False] and "unknown" in unknown.reason

    restarted, _ = agent(fabric, "holder", 3)  # same name, new incarnation, not re-added yet
    stale = await reader.read("holder", [1], [1], timeout_s=1.0)
    assert stale.outcome == "failed" and "restarted" in stale.reason
    reader.add_peer("holder", restarted.metadata())
    assert (await reader.read("holder", [1], [1], timeout_s=1.0)).outcome == "done"
    holder.close()  # the first incarnation leaves: its successor stays reachable
    assert (await reader.read("holder", [1], [1], timeout_s=1.0)).outcome == "done"

    restarted.close()
    gone = await reader.read("holder", [1, 2], [1, 2], timeout_s=1.0)
    assert gone.outcome == "failed" and gone.ok == [False, False] and "gone" in gone.reason
    reader.remove_peer("holder")
    assert not reader.has_peer("holder")
    reader.close()
    closed = await reader.read("holder", [1], [1], timeout_s=1.0)
    assert closed.outcome == "cancelled"


async def test_a_missed_deadline_fails_the_transfer() -> None:
    reader, _, holder, _ = pair(MemoryFabric())
    result = await reader.read("holder", list(range(BLOCKS)), list(range(BLOCKS)), timeout_s=-1.0)
    assert result.outcome == "failed" and not any(result.ok) and "in time" in result.reason
    reader.close()
    holder.close()


async def test_metadata_names_the_agent_and_is_refused_elsewhere() -> None:
    fabric = MemoryFabric()
    reader, _ = agent(fabric, "reader", 1)
    holder, _ = agent(fabric, "holder", 2)
    with pytest.raises(ValueError, match="not 'other'"):
        reader.add_peer("other", holder.metadata())
    stranger, _ = agent(MemoryFabric(), "stranger", 4)
    with pytest.raises(ValueError, match="another memory fabric"):
        reader.add_peer("stranger", stranger.metadata())
    small = MemoryTransport("small", np.zeros(BLOCKS * LAYER_NBYTES, dtype=np.uint8), LAYER_NBYTES, LAYER_NBYTES,
                            fabric=fabric)
    reader.add_peer("small", small.metadata())  # other block geometry: reachable by byte ranges
    assert reader.has_peer("small")
    for transport in (reader, holder, stranger, small):
        transport.close()
    assert not fabric.agent_names


async def test_out_of_range_ids_are_bugs() -> None:
    reader, _, holder, _ = pair(MemoryFabric())
    with pytest.raises(ValueError, match="out of range"):
        await reader.read("holder", [BLOCKS], [0], timeout_s=1.0)
    with pytest.raises(ValueError, match="repeat"):
        await reader.read("holder", [1, 2], [3, 3], timeout_s=1.0)
    reader.close()
    holder.close()


async def test_a_cancelled_read_waits_for_its_copy() -> None:
    reader, _, holder, _ = pair(MemoryFabric())
    task = asyncio.ensure_future(reader.read("holder", list(range(BLOCKS)), list(range(BLOCKS)), timeout_s=5.0))
    await asyncio.sleep(0)  # yield once, so that the read starts before it is cancelled
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    reader.close()
    holder.close()


async def test_fault_injection_wraps_the_memory_transport() -> None:
    fabric = MemoryFabric()
    reader, reader_pool, holder, holder_pool = pair(fabric)
    faulty = FaultInjectingTransport(reader, KvFaultConfig(cut_after_blocks=2), reader_pool, BLOCK_NBYTES)
    result = await faulty.read("holder", [1, 2, 3, 4], [5, 6, 7, 8], timeout_s=1.0)
    assert result.outcome == "failed" and result.ok == [True, True, False, False]
    assert np.array_equal(blocks(reader_pool)[[5, 6]], blocks(holder_pool)[[1, 2]])
    assert not np.array_equal(blocks(reader_pool)[7], blocks(holder_pool)[3])
    assert faulty.agent_name == "reader" and faulty.has_peer("holder")
    faulty.close()
    holder.close()


async def test_fault_injected_writes_fail_or_silently_skip_the_chosen_blocks() -> None:
    fabric = MemoryFabric()
    reader, reader_pool, holder, holder_pool = pair(fabric)
    config = KvFaultConfig(fail_fraction=0.3, corrupt_fraction=0.3, seed=2)
    faulty = FaultInjectingTransport(holder, config, holder_pool, BLOCK_NBYTES)
    faults = write_faults(config, list(range(BLOCKS)))
    before = blocks(reader_pool).copy()
    result = await faulty.write("reader", list(range(BLOCKS)), list(range(BLOCKS)), timeout_s=1.0)
    assert [i for i, ok in enumerate(result.ok) if not ok] == faults.failed
    skipped = [i for i in range(BLOCKS) if i not in faults.written]
    assert len(skipped) > len(faults.failed)  # corrupted ones too, reported written
    assert np.array_equal(blocks(reader_pool)[faults.written], blocks(holder_pool)[faults.written])
    assert np.array_equal(blocks(reader_pool)[skipped], before[skipped])
    faulty.close()
    reader.close()


def test_the_process_has_one_default_fabric() -> None:
    assert default_fabric() is default_fabric()
    transport = MemoryTransport("default-fabric-agent", pool(0), BLOCK_NBYTES, LAYER_NBYTES)
    assert transport.fabric is default_fabric() and "default-fabric-agent" in default_fabric().agent_names
    transport.close()
    assert "default-fabric-agent" not in default_fabric().agent_names


def test_the_config_names_a_known_transport() -> None:
    from shared.config import ConfigError, KvTransferConfig

    assert KvTransferConfig().transport == "nixl"
    KvTransferConfig(transport="memory").validate()
    with pytest.raises(ConfigError, match="unknown KV transport"):
        KvTransferConfig(transport="carrier-pigeon").validate()  # type: ignore[arg-type]
