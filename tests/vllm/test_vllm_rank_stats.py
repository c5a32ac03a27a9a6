"""vLLM's per-rank transfer counters ride on the ranks' reports, in this process and without
an engine (the vLLM venv's torch and NIXL): each model-worker rank (`WorkerSide`) sends its
own NIXL agent's counters with every pull's `Loaded` (and push's `Pushed`), and the Tandem
worker's `ConnectorLink` keeps each rank's latest from the reports it receives and returns
them by rank. Nothing asks vLLM's ranks for them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from connector.kv_geometry import KvShape, layer_major, rank_slices
from connector.nixl_agent import nixl_available
from connector.vllm.kv_wire import Loaded, Pinned, Pushed
from connector.vllm.settings import KvConnectorOptions
from shared.schemas.load import RankTransfers, TransferTotals

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")

from connector.vllm.connector_worker import CountedReports  # noqa: E402  (needs torch)
from connector.vllm.kv_link import ConnectorLink  # noqa: E402  (needs vLLM)
from tests.vllm.test_vllm_read_faults import HOLDER_BLOCKS, LOCAL_BLOCKS, Engine, Reports, pull  # noqa: E402


def test_each_ranks_pull_report_carries_its_own_agents_counters() -> None:
    holder = Engine(f"holder-{time.monotonic_ns()}", tensor_parallel=1, block_size=4, seed=1)
    reader = Engine(f"reader-{time.monotonic_ns()}", tensor_parallel=2, block_size=4, seed=5)
    try:
        assert [side.transfer_stats() for side in reader.ranks] == [RankTransfers(rank=0), RankTransfers(rank=1)]
        merged = pull(holder, reader, HOLDER_BLOCKS, LOCAL_BLOCKS, len(HOLDER_BLOCKS) * 4)
        reports = sorted(reader.reports.sent, key=lambda report: report.rank)
        assert [report.transfers for report in reports] == [side.transfer_stats() for side in reader.ranks]
        for report in reports:
            counters = report.transfers
            assert counters is not None and counters.rank == report.rank
            # counted after the read it reports: its bytes are in them
            assert counters.reads.nbytes == report.nbytes > 0
            assert counters.reads.transfers >= 1 and counters.reads.seconds > 0 and counters.reads.failed == 0
            assert counters.writes == TransferTotals()
        assert merged.transfers is None  # the merged outcome is no rank's
        assert holder.ranks[0].transfer_stats() == RankTransfers(rank=0)  # read from, it moved nothing itself
        assert holder.reports.sent == []
    finally:
        reader.close()
        holder.close()


def counters(rank: int, nbytes: int) -> RankTransfers:
    return RankTransfers(rank=rank, reads=TransferTotals(transfers=1, nbytes=nbytes))


def test_a_push_report_leaves_with_the_counters_read_as_it_is_sent() -> None:
    sent, now = Reports(), [counters(1, 10)]
    reports = CountedReports(sent, lambda: now[0])
    reports.send(Pushed(transfer_id="t", ok=[True], checksums=[0], rank=1))
    now[0] = counters(1, 20)
    reports.send(Pushed(transfer_id="u", ok=[True], checksums=[0], rank=1))
    reports.send(Pinned(key="k", block_ids=[3]))  # the scheduler side's: no rank, no counters
    assert [getattr(report, "transfers", None) for report in sent.sent] == [counters(1, 10), counters(1, 20), None]
    assert sent.sent[2] == Pinned(key="k", block_ids=[3])


async def test_the_link_keeps_each_ranks_latest_counters_from_its_reports(tmp_path: Path) -> None:
    link = ConnectorLink(KvConnectorOptions(control_timeout_s=0.2), str(tmp_path))
    assert link.rank_transfers() == []  # not started: no shape, no ranks
    link._shape = KvShape(block_size=4, num_layers=1, num_kv_heads=3, ranks=[  # noqa: SLF001  (what start learns)
        layer_major(part, num_blocks=4, block_size=4, token_nbytes=8) for part in rank_slices(1, 3, 3)])
    link.loads.ranks = link.pushes.ranks = 3
    assert link.rank_transfers() == [RankTransfers(rank=rank) for rank in range(3)]  # none heard from: zeros

    waiter = link.loads.expect("t")
    for rank in (2, 0):  # in whatever order the ranks' reports come
        link._on_report(Loaded(transfer_id="t", lease_id="l", cached_blocks=0, ok=[True], rank=rank,  # noqa: SLF001
                               transfers=counters(rank, 100)))
    link._on_report(Pushed(transfer_id="late", ok=[True], checksums=[0], rank=0,  # noqa: SLF001  (nobody waits)
                           transfers=counters(0, 300)))
    link._on_report(Loaded(transfer_id="old", lease_id="l", cached_blocks=0, ok=[], rank=2))  # noqa: SLF001
    link._on_report(Pinned(key="k", block_ids=[]))  # noqa: SLF001
    assert link.rank_transfers() == [counters(0, 300), RankTransfers(rank=1), counters(2, 100)]
    assert not waiter.done()  # the reports still go where they went: rank 1's is missing
    link._on_report(Loaded(transfer_id="t", lease_id="l", cached_blocks=0, ok=[True], rank=1,  # noqa: SLF001
                           transfers=counters(1, 50)))
    merged = await asyncio.wait_for(waiter, 1.0)
    assert (merged.ok, merged.transfers) == ([True], None)
    assert link.rank_transfers() == [counters(0, 300), counters(1, 50), counters(2, 100)]
    assert link.late_reports == 3  # the push, the counter-less pull and the pin nobody waited for

