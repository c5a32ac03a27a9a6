"""Per-rank transfer counters: the memory transport counts as a NIXL agent does (reads and
writes apart, bytes, seconds and rows of the done ones, failures by outcome), they reach the
load snapshot's shape (`RankTransfers`), and a vLLM rank's pull and push reports carry them
to the Tandem worker (older senders' reports, without them, still decode). No NIXL, no NATS."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np

from connector.agent_types import AgentStats, TransferCounts
from connector.memory_transport import MemoryFabric, MemoryTransport
from connector.rank_transports import transport_stats
from connector.vllm.kv_wire import Loaded, Pushed, decode_report, encode_report, merge_loaded, merge_pushed
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


def counters(rank: int, nbytes: int) -> RankTransfers:
    return RankTransfers(rank=rank, reads=TransferTotals(transfers=1, nbytes=nbytes),
                         writes=TransferTotals(transfers=2, nbytes=3 * nbytes, failed=1))


def test_pull_and_push_reports_carry_the_ranks_counters_and_older_ones_decode_without() -> None:
    loaded = Loaded(transfer_id="t", lease_id="l", cached_blocks=0, ok=[True], rank=1, transfers=counters(1, 64))
    pushed = Pushed(transfer_id="t", ok=[True], checksums=[7], rank=1, heads=[0], transfers=counters(1, 96))
    for report in (loaded, pushed):
        assert decode_report(encode_report(report)) == report
        fields = {k: v for k, v in msgspec.structs.asdict(report).items() if k != "transfers"}
        older = msgspec.msgpack.encode({"type": report.__struct_config__.tag, **msgspec.to_builtins(fields)})
        assert decode_report(older) == msgspec.structs.replace(report, transfers=None)


def test_merged_reports_leave_the_counters_with_each_ranks_own() -> None:
    loads = [Loaded(transfer_id="t", lease_id="l", cached_blocks=0, ok=[True, rank == 0], nbytes=10, rank=rank,
                    transfers=counters(rank, 10)) for rank in range(2)]
    merged = merge_loaded(loads)
    assert (merged.ok, merged.nbytes, merged.transfers) == ([True, False], 20, None)
    pushes = [Pushed(transfer_id="t", ok=[True], checksums=[rank + 5], rank=rank, heads=[rank],
                     transfers=counters(rank, 20)) for rank in range(2)]
    merged_push = merge_pushed(pushes, num_kv_heads=2)
    assert (merged_push.checksums, merged_push.transfers) == ([5, 6], None)
