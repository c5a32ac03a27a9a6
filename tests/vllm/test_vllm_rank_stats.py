"""vLLM's per-rank transfer counters, in this process and without an engine (the vLLM venv's
torch and NIXL): each model-worker rank (`WorkerSide`) answers its own NIXL agent's counters
through the `tandem_transfer_stats` worker extension, the Tandem worker's `ConnectorLink`
gathers them by rank, and the data plane's poll keeps its last answer when a question times
out or the engine is gone."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest

from connector.dataplane import RankTransfersPoll
from connector.nixl_agent import nixl_available
from connector.vllm.settings import KvConnectorOptions
from shared.schemas.load import RankTransfers, TransferTotals

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")

from connector.vllm import tandem_connector  # noqa: E402  (needs vLLM)
from connector.vllm.kv_link import ConnectorLink  # noqa: E402
from tests.vllm.test_vllm_read_faults import HOLDER_BLOCKS, LOCAL_BLOCKS, Engine, pull  # noqa: E402


def test_each_rank_answers_its_own_agents_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    holder = Engine(f"holder-{time.monotonic_ns()}", tensor_parallel=1, block_size=4, seed=1)
    reader = Engine(f"reader-{time.monotonic_ns()}", tensor_parallel=2, block_size=4, seed=5)
    try:
        assert [side.transfer_stats() for side in reader.ranks] == [RankTransfers(rank=0), RankTransfers(rank=1)]
        report = pull(holder, reader, HOLDER_BLOCKS, LOCAL_BLOCKS, len(HOLDER_BLOCKS) * 4)
        answers = [side.transfer_stats() for side in reader.ranks]
        assert [answer.rank for answer in answers] == [0, 1]
        assert sum(answer.reads.nbytes for answer in answers) == report.nbytes > 0
        for answer in answers:
            assert answer.reads.transfers >= 1 and answer.reads.seconds > 0 and answer.reads.failed == 0
            assert answer.writes == TransferTotals()
        assert holder.ranks[0].transfer_stats() == RankTransfers(rank=0)  # read from, it moved nothing itself
        for side, answer in zip(reader.ranks, answers):  # the extension method, as collective_rpc calls it
            monkeypatch.setattr(tandem_connector, "_worker_side", lambda side=side: side)
            payload = tandem_connector.TandemWorkerExtension().tandem_transfer_stats()
            assert msgspec.msgpack.decode(payload, type=RankTransfers) == answer
    finally:
        reader.close()
        holder.close()


class Llm:
    """vLLM's AsyncLLM as the link sees it: `collective_rpc` answers each rank's payload (in
    whatever order), or never (a stuck engine)."""

    def __init__(self, answers: list[RankTransfers] | None) -> None:
        self.answers = answers
        self.asked = 0

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = ()) -> list[bytes]:
        assert method == "tandem_transfer_stats" and args == ()
        # never vLLM's own timeout: ranks answering after it desynchronize its response queue
        assert timeout is None
        self.asked += 1
        if self.answers is None:
            await asyncio.Event().wait()
        return [msgspec.msgpack.encode(answer) for answer in self.answers or []]


def ranks(nbytes: int) -> list[RankTransfers]:
    return [RankTransfers(rank=rank, reads=TransferTotals(transfers=1, nbytes=nbytes + rank)) for rank in range(2)]


async def settle(poll: RankTransfersPoll) -> None:
    """Until the poll's question is answered or given up."""
    deadline = time.monotonic() + 5
    while poll._asking is not None and not poll._asking.done():  # noqa: SLF001
        assert time.monotonic() < deadline, "the question never ended"
        await asyncio.sleep(0.01)


async def test_the_link_gathers_ranks_and_the_poll_keeps_the_last_answer(tmp_path: Path) -> None:
    link = ConnectorLink(KvConnectorOptions(control_timeout_s=0.2), str(tmp_path))
    link._llm = Llm(list(reversed(ranks(100))))  # type: ignore[assignment]  # noqa: SLF001
    assert await link.rank_transfers() == ranks(100)  # by rank, whatever order the ranks answered in

    poll = RankTransfersPoll()
    assert poll.latest(link.rank_transfers) == []
    await settle(poll)
    assert poll.latest(link.rank_transfers) == ranks(100)
    await settle(poll)
    link._llm = stuck = Llm(None)  # type: ignore[assignment]  # noqa: SLF001
    assert poll.latest(link.rank_transfers) == ranks(100)
    await asyncio.sleep(0.05)
    assert poll.latest(link.rank_transfers) == ranks(100) and stuck.asked == 1  # one question out at a time
    await settle(poll)  # timed out (control_timeout_s)
    link._llm = None  # noqa: SLF001  (the engine stopped)
    assert poll.latest(link.rank_transfers) == ranks(100)
    await settle(poll)
    assert poll.latest(link.rank_transfers) == ranks(100)
    await poll.stop()
