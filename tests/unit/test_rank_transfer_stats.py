"""Per-rank transfer counters: the memory transport counts as a NIXL agent does (reads and
writes apart, bytes, seconds and rows of the done ones, failures by outcome), they reach the
load snapshot's shape (`RankTransfers`), and a data plane whose ranks live in other processes
asks for them in the background, keeping the last answer. No NIXL, no NATS."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np

from connector.agent_types import AgentStats, TransferCounts
from connector.dataplane import RankTransfersPoll
from connector.leases import LeaseTable
from connector.memory_transport import MemoryFabric, MemoryTransport
from connector.rank_transports import transport_stats
from shared.schemas.load import LoadSnapshot, RankTransfers, TransferTotals
from tests.unit.test_memory_transport import BLOCK_NBYTES, LAYER_NBYTES, pair


async def test_the_memory_transport_counts_reads_and_writes_apart() -> None:
    reader, _, holder, _ = pair(MemoryFabric())
    assert reader.stats == AgentStats()
    await reader.read("holder", [3, 4, 9], [10, 11, 2], timeout_s=1.0)
    await reader.write("holder", [1, 2], [5, 6], timeout_s=1.0, layer=2)
    await reader.read_ranges("holder", [0, 100, 500], [0, 100, 900], [100, 50, 20], timeout_s=1.0)
    stats = reader.stats
    assert stats.reads.transfers == 2 and stats.reads.nbytes == 3 * BLOCK_NBYTES + 170
    assert stats.reads.descriptors == 3 + 2  # three blocks; two ranges once the adjacent pair merged
    assert stats.reads.seconds > 0 and (stats.reads.failed, stats.reads.cancelled) == (0, 0)
    assert (stats.writes.transfers, stats.writes.nbytes, stats.writes.descriptors) == (1, 2 * LAYER_NBYTES, 2)
    assert holder.stats == AgentStats()  # the peer's agent moved nothing itself
    reader.close()
    holder.close()


async def test_failed_and_cancelled_transfers_count_no_bytes() -> None:
    reader, _, holder, _ = pair(MemoryFabric())
    before = reader.stats
    await reader.read("nobody", [1], [1], timeout_s=1.0)
    await reader.read_ranges("nobody", [0], [0], [8], timeout_s=1.0)
    assert before.reads == TransferCounts()  # a snapshot: later transfers do not change it
    reader.close()
    await reader.write("holder", [1], [1], timeout_s=1.0)
    reads, writes = reader.stats.reads, reader.stats.writes
    assert (reads.transfers, reads.failed, reads.nbytes, reads.descriptors) == (2, 2, 0, 0)
    assert (writes.transfers, writes.cancelled, writes.nbytes, writes.seconds) == (1, 1, 0, 0.0)
    holder.close()


async def test_a_transfer_whose_caller_left_is_counted_when_its_copy_ends() -> None:
    reader, _, holder, _ = pair(MemoryFabric())
    read = asyncio.ensure_future(reader.read("holder", list(range(32)), list(range(32)), timeout_s=1.0))
    await asyncio.sleep(0)
    read.cancel()
    await asyncio.gather(read, return_exceptions=True)
    assert reader.stats.reads.transfers == 1
    reader.close()
    holder.close()


def test_agent_stats_become_a_ranks_entry_of_the_load_snapshot() -> None:
    stats = AgentStats(reads=TransferCounts(transfers=3, nbytes=4096, seconds=0.5, descriptors=6, failed=1),
                       writes=TransferCounts(transfers=1, cancelled=1))
    rank = stats.of_rank(2)
    assert rank == RankTransfers(rank=2, reads=TransferTotals(transfers=3, nbytes=4096, seconds=0.5, descriptors=6,
                                                              failed=1),
                                 writes=TransferTotals(transfers=1, cancelled=1))
    snapshot = LoadSnapshot(worker_id="w", seq=1, ts=0.0, running=0, waiting=0, kv_total_blocks=1, kv_used_blocks=0,
                            kv_cached_blocks=0, prompt_tokens_total=0, cached_tokens_total=0,
                            generated_tokens_total=0, pending_prefill_tokens=0, kv_ranks=[rank])
    wire = msgspec.msgpack.encode(snapshot)
    assert msgspec.msgpack.decode(wire, type=LoadSnapshot).kv_ranks == [rank]
    # A snapshot from a worker that predates the field decodes with no ranks.
    old = msgspec.msgpack.encode({k: v for k, v in msgspec.structs.asdict(snapshot).items() if k != "kv_ranks"})
    assert msgspec.msgpack.decode(old, type=LoadSnapshot).kv_ranks == []


class CountingAgent:
    stats = AgentStats(reads=TransferCounts(transfers=7))


class AgentTransport:  # how NixlTransport keeps its KvAgent
    _agent = CountingAgent()


def test_transport_stats_reads_the_transport_or_its_agent() -> None:
    buffer = np.zeros(4 * BLOCK_NBYTES, dtype=np.uint8)
    memory = MemoryTransport("m", buffer, BLOCK_NBYTES, LAYER_NBYTES, fabric=MemoryFabric())
    assert transport_stats(memory) is memory.stats
    assert transport_stats(AgentTransport()).reads.transfers == 7  # type: ignore[arg-type]
    assert transport_stats(object()) == AgentStats()  # type: ignore[arg-type]
    memory.close()


def ranks(nbytes: int) -> list[RankTransfers]:
    return [RankTransfers(rank=rank, reads=TransferTotals(transfers=1, nbytes=nbytes)) for rank in range(2)]


async def test_the_poll_answers_at_once_and_asks_once_at_a_time() -> None:
    poll = RankTransfersPoll()
    asked = 0
    release = asyncio.Event()

    async def ask() -> list[RankTransfers]:
        nonlocal asked
        asked += 1
        await release.wait()
        return ranks(100 * asked)

    assert poll.latest(ask) == []  # nothing known yet: the question goes out in the background
    await asyncio.sleep(0)
    assert poll.latest(ask) == [] and asked == 1  # still out: not asked again
    release.set()
    for _ in range(3):
        await asyncio.sleep(0)
    assert poll.latest(ask) == ranks(100) and asked == 1
    for _ in range(3):
        await asyncio.sleep(0)
    assert poll.latest(ask) == ranks(200) and asked == 2
    await poll.stop()


async def test_an_idle_workers_ranks_are_asked_once_until_kv_moves_again() -> None:
    poll = RankTransfersPoll()
    asked = 0

    async def ask() -> list[RankTransfers]:
        nonlocal asked
        asked += 1
        return ranks(100 * asked)

    for _ in range(5):  # the same activity, load report after load report: one question
        poll.latest(ask, ("idle",))
        for _ in range(3):
            await asyncio.sleep(0)
    assert asked == 1 and poll.latest(ask, ("idle",)) == ranks(100)
    poll.latest(ask, ("moved",))
    for _ in range(3):
        await asyncio.sleep(0)
    assert asked == 2 and poll.latest(ask, ("moved",)) == ranks(200)
    await poll.stop()


async def test_a_failed_or_stuck_question_keeps_the_last_answer() -> None:
    poll = RankTransfersPoll()
    poll.answer = ranks(5)

    async def dead() -> list[RankTransfers]:
        raise RuntimeError("the engine is dead")

    assert poll.latest(dead) == ranks(5)
    for _ in range(3):
        await asyncio.sleep(0)
    assert poll.latest(dead) == ranks(5)

    async def stuck() -> list[RankTransfers]:
        await asyncio.Event().wait()
        return []

    for _ in range(3):
        await asyncio.sleep(0)
    assert poll.latest(stuck) == ranks(5)
    await poll.stop()  # cancels the question still out
    assert poll.answer == ranks(5)


def test_the_data_planes_kv_activity_changes_when_leases_end_or_pulls_count() -> None:
    from connector.dataplane import LeasingDataPlane, Prepared

    class Holder:
        leases = LeaseTable("h")

    plane = LeasingDataPlane("w", None, None, Holder())  # type: ignore[arg-type]
    idle = plane.kv_activity()
    assert plane.kv_activity() == idle
    lease = Holder.leases.grant("r", [1, 2], 10.0, now=0.0)
    granted = plane.kv_activity()
    Holder.leases.release(lease.lease_id, "done")
    assert len({idle, granted, plane.kv_activity()}) == 3
    plane._count(Prepared(pulled_tokens=16))  # noqa: SLF001
    assert plane.kv_activity() not in (idle, granted)
