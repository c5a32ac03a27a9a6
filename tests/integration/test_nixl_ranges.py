"""KvAgent byte ranges, peers of another block size, transfer counters, the completion wait
and the UCX environment: two real agents in one process over NIXL (UCX on DRAM)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from connector.agent_types import KvAgentConfig, TransferOutcome
from connector.nixl_agent import KvAgent, nixl_available
from connector.nixl_runtime import allow_cuda_ipc_reads, load_nixl
from connector.nixl_transport import NixlTransport
from connector.xfer_requests import wait_for_transfer
from shared.errors import ErrorCode
from tests.waiting import wait_for_sync

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (pip install nixl-cu12)")

SMALL, LARGE = 1024, 4096  # the two agents' block sizes
POOL_NBYTES = 64 * 1024
CUDA_IPC_GET = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"


def pattern(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, POOL_NBYTES, dtype=np.uint8)


class Pair:
    """Two connected agents: `small` (1 KiB blocks) and `large` (4 KiB blocks), pools apart."""

    def __init__(self, name: str) -> None:
        self.small_pool, self.large_pool = pattern(1), pattern(2)
        self.small = KvAgent(f"{name}-small")
        self.large = KvAgent(f"{name}-large")
        self.small.register_pool(self.small_pool, SMALL)
        self.large.register_pool(self.large_pool, LARGE)
        self.small.add_peer(self.large.name, self.large.metadata())
        self.large.add_peer(self.small.name, self.small.metadata())

    def close(self) -> None:
        self.small.close()
        self.large.close()


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    agents = Pair(request.node.name[:40])
    try:
        yield agents
    finally:
        agents.close()


def test_read_ranges_lands_exactly_those_bytes(pair):
    before, source = pair.small_pool.copy(), pair.large_pool.copy()
    remote, local, lengths = [100, 200, 40_000], [5000, 5100, 7], [100, 33, 4096]
    result = pair.small.read_ranges(pair.large.name, remote, local, lengths, timeout_s=10)
    assert result.outcome is TransferOutcome.DONE, result
    assert result.nbytes == 100 + 33 + 4096 and result.num_blocks == 0
    assert result.descriptors == 2  # 100..200 -> 5000..5100 continues on both sides
    expected = before.copy()
    for r, lo, n in zip(remote, local, lengths):
        expected[lo:lo + n] = source[r:r + n]
    assert np.array_equal(pair.small_pool, expected)  # and not a byte more
    assert np.array_equal(pair.large_pool, source)


async def test_write_ranges_lands_in_the_peer_with_a_notification(pair):
    before, source = pair.large_pool.copy(), pair.small_pool.copy()
    remote, local, lengths = np.array([0, 65_000]), np.array([1, 2]), np.array([3000, 536])
    result = await pair.small.awrite_ranges(pair.large.name, remote, local, lengths, timeout_s=10, notify=b"tp-2:done")
    assert result.ok and result.descriptors == 2, result
    expected = before.copy()
    for r, lo, n in zip(remote, local, lengths):
        expected[r:r + n] = source[lo:lo + n]
    assert np.array_equal(pair.large_pool, expected)
    notes: dict[str, list[bytes]] = {}

    def arrived() -> bool:
        notes.update(pair.large.take_notifications())
        return bool(notes)

    wait_for_sync(arrived, 5, "the write's notification", interval_s=0.001)
    assert notes == {pair.small.name: [b"tp-2:done"]}


async def test_async_range_read_and_an_empty_transfer(pair):
    result = await pair.small.aread_ranges(pair.large.name, [8192], [0], [8192], timeout_s=10)
    assert result.ok and np.array_equal(pair.small_pool[:8192], pair.large_pool[8192:16384])
    empty = pair.small.read_ranges(pair.large.name, [], [], [])
    assert empty.outcome is TransferOutcome.DONE and empty.nbytes == 0 and empty.descriptors == 0


def test_rows_outside_a_pool_or_overlapping_at_the_destination_are_bugs(pair):
    peer = pair.large.name
    with pytest.raises(ValueError, match="remote range"):
        pair.small.read_ranges(peer, [POOL_NBYTES - 10], [0], [11])
    with pytest.raises(ValueError, match="local range"):
        pair.small.read_ranges(peer, [0], [-1], [10])
    with pytest.raises(ValueError, match="local ranges overlap"):
        pair.small.read_ranges(peer, [0, 100], [0, 50], [100, 100])
    with pytest.raises(ValueError, match="remote ranges overlap"):
        pair.small.write_ranges(peer, [0, 50], [0, 100], [100, 100])
    with pytest.raises(ValueError):
        pair.small.read_ranges(peer, [0, 1], [0], [1, 1])


def test_a_peer_of_another_block_size_fails_block_transfers_and_takes_ranges(pair):
    before = pair.small_pool.copy()
    for result in (pair.small.read_blocks(pair.large.name, [0], [0]),
                   pair.small.write_blocks(pair.large.name, [0], [0]),
                   pair.small.write_layer(pair.large.name, [0], [0], layer_offset=0, layer_nbytes=256)):
        assert result.outcome is TransferOutcome.FAILED and result.error is ErrorCode.INVALID_ARGUMENT, result
        assert "4096-byte blocks" in result.detail and "1024-byte blocks" in result.detail
    assert np.array_equal(pair.small_pool, before)
    assert pair.small.read_ranges(pair.large.name, [LARGE], [0], [SMALL]).ok
    assert np.array_equal(pair.small_pool[:SMALL], pair.large_pool[LARGE:LARGE + SMALL])


async def test_nixl_transport_offers_the_range_api_with_one_flag():
    pools = {"tp-small": pattern(3), "tp-large": pattern(4)}
    sides = {name: NixlTransport(name, pool, block, block // 4, progress_delay_us=10_000, transfer_timeout_s=5)
             for (name, pool), block in zip(pools.items(), (SMALL, LARGE))}
    try:
        sides["tp-small"].add_peer("tp-large", sides["tp-large"].metadata())
        read = await sides["tp-small"].read_ranges("tp-large", [LARGE], [0], [SMALL + 1], timeout_s=5)
        assert read.outcome == "done" and read.ok == [True] and read.nbytes == SMALL + 1, read
        assert np.array_equal(pools["tp-small"][:SMALL + 1], pools["tp-large"][LARGE:LARGE + SMALL + 1])
        write = await sides["tp-small"].write_ranges("tp-large", [0], [SMALL], [7], timeout_s=5)
        assert write.ok == [True] and np.array_equal(pools["tp-large"][:7], pools["tp-small"][SMALL:SMALL + 7])
        blocks = await sides["tp-small"].read("tp-large", [0, 1], [0, 1], timeout_s=5)
        assert blocks.outcome == "failed" and blocks.ok == [False, False] and "4096-byte" in blocks.reason
    finally:
        for side in sides.values():
            side.close()


def test_stats_count_reads_and_writes_apart(pair):
    agent, peer = pair.small, pair.large.name
    assert agent.stats.reads.transfers == 0 and agent.stats.writes.transfers == 0
    assert agent.read_ranges(peer, [0, 10], [0, 10], [10, 10]).ok  # one merged descriptor
    assert agent.read_ranges(peer, [0, 100], [0, 200], [10, 10]).ok  # two
    snapshot = agent.stats
    assert not agent.read_blocks(peer, [0], [0]).ok  # another block size: failed
    assert not agent.read_blocks("nobody", [0], [0]).ok
    assert agent.write_ranges(peer, [0], [0], [2048]).ok
    stats = agent.stats
    assert (stats.reads.transfers, stats.reads.nbytes, stats.reads.descriptors) == (4, 40, 3)
    assert (stats.reads.failed, stats.reads.cancelled) == (2, 0) and stats.reads.seconds > 0
    assert (stats.writes.transfers, stats.writes.nbytes, stats.writes.descriptors, stats.writes.failed) == \
        (1, 2048, 1, 0)
    assert snapshot.reads.transfers == 2 and snapshot.writes.transfers == 0  # a snapshot stays as it was
    assert pair.large.stats.reads.transfers == pair.large.stats.writes.transfers == 0  # the passive side
    agent.close()
    assert agent.read_ranges(peer, [0], [0], [1]).outcome is TransferOutcome.CANCELLED
    assert agent.stats.reads.cancelled == 1


@pytest.mark.parametrize("name", ["spin_us", "vram_spin_us"])
@pytest.mark.parametrize("spin_us", [-1, 10_001])
def test_the_spin_is_validated(name, spin_us):
    with pytest.raises(ValueError, match=name):
        KvAgentConfig(**{name: spin_us}).validate()
    with pytest.raises(ValueError, match=name):
        KvAgent("bad-spin", KvAgentConfig(**{name: spin_us}))


def test_a_transfer_touching_gpu_memory_spins_longer():
    config = KvAgentConfig(spin_us=100, vram_spin_us=4_000)
    assert config.spin_us_between("DRAM", "DRAM") == 100
    assert config.spin_us_between("VRAM", "DRAM") == config.spin_us_between("DRAM", "VRAM") == 4_000
    assert config.spin_us_between("VRAM", "VRAM") == 4_000


class InProgressFor:
    """Stands in for the NIXL bindings agent's `getXferStatus` in `wait_for_transfer`: a
    transfer that reports "in progress" until `seconds` have passed, as a GPU-memory transfer
    does (one on DRAM is done inside its post, so it never reaches the wait)."""

    def __init__(self, nixl, seconds: float) -> None:
        self.nixl, self.polls = nixl, 0
        self.done_at = time.perf_counter() + seconds

    def getXferStatus(self, handle: int):  # noqa: N802 - the bindings' name
        self.polls += 1
        return self.nixl.NIXL_SUCCESS if time.perf_counter() >= self.done_at else self.nixl.NIXL_IN_PROG


def wait_polls(spin_us: int, seconds: float, timeout_s: float = 5.0,
               cancel: threading.Event | None = None) -> tuple[tuple, int, float]:
    nixl = load_nixl()
    fake = InProgressFor(nixl, seconds)
    started = time.perf_counter()
    ended = wait_for_transfer(nixl, fake.getXferStatus, "READ", 0, nixl.NIXL_IN_PROG, started + timeout_s, spin_us,
                              cancel)
    return ended, fake.polls, time.perf_counter() - started


def test_the_wait_spins_through_a_short_transfer_and_backs_off_on_a_long_one():
    ended, spun, _ = wait_polls(spin_us=10_000, seconds=2e-3)
    assert ended == (TransferOutcome.DONE, None, "")
    ended, slept, _ = wait_polls(spin_us=0, seconds=2e-3)  # the old wait: 20 us doubling to 1 ms
    assert ended[0] is TransferOutcome.DONE
    assert spun > 200 and slept < 30, (spun, slept)
    # After the spin, at most one poll a millisecond: ~100 in 0.1 s, not a core's worth
    _, backed_off, elapsed = wait_polls(spin_us=0, seconds=0.1)
    assert elapsed >= 0.1 and backed_off < 400, backed_off
    _, polls, _ = wait_polls(spin_us=200, seconds=0.1)
    assert polls < 5_000, polls


def test_the_wait_ends_at_the_deadline_or_on_cancel():
    ended, _, elapsed = wait_polls(spin_us=200, seconds=10, timeout_s=0.05)
    assert ended[:2] == (TransferOutcome.FAILED, ErrorCode.TIMEOUT) and elapsed < 1
    cancel = threading.Event()
    cancel.set()
    ended, _, _ = wait_polls(spin_us=200, seconds=10, cancel=cancel)
    assert ended[:2] == (TransferOutcome.CANCELLED, ErrorCode.CANCELLED)


@pytest.fixture
def ucx_env() -> Iterator[None]:
    """The process without UCX_CUDA_IPC_ENABLE_GET_ZCOPY; as it was afterwards."""
    saved = os.environ.pop(CUDA_IPC_GET, None)
    try:
        yield
    finally:
        os.environ.pop(CUDA_IPC_GET, None)
        if saved is not None:
            os.environ[CUDA_IPC_GET] = saved


def registered(name: str, config: KvAgentConfig = KvAgentConfig()) -> None:
    with KvAgent(name, config) as agent:
        agent.register_pool(np.zeros(4096, dtype=np.uint8), 1024)


def test_cuda_ipc_reads_are_switched_on_before_ucx_starts_for_gpu_memory(ucx_env, caplog):
    with caplog.at_level(logging.INFO, logger="connector.nixl_runtime"):
        allow_cuda_ipc_reads("ipc-on", True, "VRAM")
    assert os.environ[CUDA_IPC_GET] == "y"
    assert f"{CUDA_IPC_GET}=y" in caplog.text


def test_a_host_memory_pool_leaves_ucx_its_default(ucx_env, caplog):
    with caplog.at_level(logging.INFO, logger="connector.nixl_runtime"):
        registered("ipc-dram")
    assert CUDA_IPC_GET not in os.environ  # else UCX without CUDA warns about it on stdout
    assert f"{CUDA_IPC_GET}=auto" in caplog.text and "host memory" in caplog.text


def test_the_operators_setting_is_left_alone(ucx_env, caplog):
    os.environ[CUDA_IPC_GET] = "n"
    with caplog.at_level(logging.INFO, logger="connector.nixl_runtime"):
        registered("ipc-operator")
    assert os.environ[CUDA_IPC_GET] == "n"
    assert f"{CUDA_IPC_GET}=n" in caplog.text and "left alone" in caplog.text


def test_cuda_ipc_reads_off_leaves_ucx_its_default(ucx_env, caplog):
    with caplog.at_level(logging.INFO, logger="connector.nixl_runtime"):
        allow_cuda_ipc_reads("ipc-off", False, "VRAM")
    assert CUDA_IPC_GET not in os.environ
    assert f"{CUDA_IPC_GET}=auto" in caplog.text
