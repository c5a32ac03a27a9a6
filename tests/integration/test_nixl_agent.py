"""KvAgent between two processes over real NIXL (UCX on DRAM): bytes, outcomes, idle CPU.

The peer is a spawned process holding its own KvAgent, driven over a pipe; metadata goes
through the pipe as it would go through NATS.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

from bench.transfer import idle_cpu_percent
from connector.agent_types import TransferOutcome
from connector.nixl_agent import KvAgent, nixl_available
from shared.errors import ErrorCode
from tests.waiting import wait_for_sync

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (pip install nixl-cu12)")

NUM_BLOCKS = 64
BLOCK_NBYTES = 4096
LAYERS = 4
LAYER_NBYTES = BLOCK_NBYTES // LAYERS


def block_content(owner: str, block_id: int) -> np.ndarray:
    """Every byte of a block depends on who wrote it and which block it is."""
    seed = sum(owner.encode()) * 1_000_003 + block_id
    return np.random.default_rng(seed).integers(0, 256, BLOCK_NBYTES, dtype=np.uint8)


def filled_pool(owner: str, num_blocks: int = NUM_BLOCKS) -> np.ndarray:
    return np.concatenate([block_content(owner, b) for b in range(num_blocks)])


def _peer_main(conn: Connection, name: str, num_blocks: int) -> None:
    pool = filled_pool(name, num_blocks)
    blocks = pool.reshape(num_blocks, BLOCK_NBYTES)
    with KvAgent(name) as agent:
        agent.register_pool(pool, BLOCK_NBYTES)
        conn.send_bytes(agent.metadata())
        while True:
            command, *args = conn.recv()
            if command == "stop":
                return
            if command == "add_peer":
                agent.add_peer(*args)
                conn.send(None)
            elif command == "blocks":
                conn.send(blocks[list(args[0])].copy())
            elif command == "notifications":
                conn.send(_notifications(agent, args[0]))
            elif command == "idle_cpu":
                conn.send(idle_cpu_percent(args[0]))


def _notifications(agent: KvAgent, timeout_s: float) -> dict[str, list[bytes]]:
    """The notifications that arrived first, within `timeout_s`; none if none did (the
    caller's comparison then shows it)."""
    received: dict[str, list[bytes]] = {}

    def arrived() -> bool:
        received.update(agent.take_notifications())
        return bool(received)

    try:
        wait_for_sync(arrived, timeout_s, "a notification", interval_s=0.001)
    except AssertionError:
        pass
    return received


class Peer:
    def __init__(self, name: str, num_blocks: int = NUM_BLOCKS) -> None:
        self.name = name
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=_peer_main, args=(child, name, num_blocks), daemon=True)
        self.process.start()
        self._wait(60)
        self.metadata = self._conn.recv_bytes()

    def _wait(self, timeout_s: float) -> None:
        def answered() -> bool:
            if self._conn.poll(0.05):  # blocks up to 0.05 s: the poll interval
                return True
            assert self.process.is_alive(), f"peer {self.name} exited with {self.process.exitcode}"
            return False

        wait_for_sync(answered, timeout_s, f"peer {self.name} to answer", interval_s=0)

    def call(self, *command: Any, timeout_s: float = 30) -> Any:
        self._conn.send(command)
        self._wait(timeout_s)
        return self._conn.recv()

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send(("stop",))
            except OSError:
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


@pytest.fixture
def local_agent() -> Iterator[tuple[KvAgent, np.ndarray]]:
    pool = np.zeros(NUM_BLOCKS * BLOCK_NBYTES, dtype=np.uint8)
    with KvAgent("local") as agent:
        agent.register_pool(pool, BLOCK_NBYTES)
        yield agent, pool.reshape(NUM_BLOCKS, BLOCK_NBYTES)


@pytest.fixture
def peer(local_agent: tuple[KvAgent, np.ndarray]) -> Iterator[Peer]:
    agent, _ = local_agent
    remote = Peer("remote")
    try:
        agent.add_peer(remote.name, remote.metadata)
        remote.call("add_peer", agent.name, agent.metadata())
        yield remote
    finally:
        remote.stop()


def test_read_blocks_copies_exact_bytes(local_agent, peer):
    agent, blocks = local_agent
    remote_ids = [10, 11, 12, 40, 3, 63]
    local_ids = [0, 1, 2, 20, 33, 5]
    result = agent.read_blocks(peer.name, remote_ids, local_ids, timeout_s=10)
    assert result.outcome is TransferOutcome.DONE, result
    assert result.nbytes == len(remote_ids) * BLOCK_NBYTES
    assert result.descriptors == 4  # 10..12 -> 0..2 is one descriptor
    for remote_id, local_id in zip(remote_ids, local_ids):
        assert np.array_equal(blocks[local_id], block_content(peer.name, remote_id))
    untouched = sorted(set(range(NUM_BLOCKS)) - set(local_ids))
    assert not blocks[untouched].any()


def test_write_blocks_lands_in_the_peer_pool_with_a_notification(local_agent, peer):
    agent, blocks = local_agent
    for block_id in range(NUM_BLOCKS):
        blocks[block_id] = block_content(agent.name, block_id)
    result = agent.write_blocks(peer.name, [5, 6, 7, 30], [1, 2, 3, 9], timeout_s=10, notify=b"req-1:done")
    assert result.ok, result
    assert peer.call("notifications", 5.0) == {agent.name: [b"req-1:done"]}
    got = peer.call("blocks", [5, 6, 7, 30, 8])
    for row, local_id in zip(got, [1, 2, 3, 9]):
        assert np.array_equal(row, block_content(agent.name, local_id))
    assert np.array_equal(got[4], block_content(peer.name, 8))  # a neighbour stays intact


def test_write_layer_touches_only_that_layer(local_agent, peer):
    agent, blocks = local_agent
    blocks[:] = 0xAB
    layer = 2
    result = agent.write_layer(peer.name, [20, 21, 22], [0, 1, 2], layer_offset=layer * LAYER_NBYTES,
                               layer_nbytes=LAYER_NBYTES, timeout_s=10, notify=b"layer-2")
    assert result.ok, result
    assert result.nbytes == 3 * LAYER_NBYTES and result.descriptors == 3
    assert peer.call("notifications", 5.0) == {agent.name: [b"layer-2"]}
    for remote_id, got in zip([20, 21, 22], peer.call("blocks", [20, 21, 22])):
        original = block_content(peer.name, remote_id)
        start, end = layer * LAYER_NBYTES, (layer + 1) * LAYER_NBYTES
        assert (got[start:end] == 0xAB).all()
        assert np.array_equal(got[:start], original[:start]) and np.array_equal(got[end:], original[end:])


async def test_async_read_runs_off_the_event_loop(local_agent, peer):
    agent, blocks = local_agent
    result = await agent.aread_blocks(peer.name, list(range(NUM_BLOCKS)), list(range(NUM_BLOCKS)), timeout_s=10)
    assert result.ok and result.descriptors == 1
    assert np.array_equal(blocks, filled_pool(peer.name).reshape(NUM_BLOCKS, BLOCK_NBYTES))


async def test_cancelled_async_read_returns_only_after_the_copy_stopped(local_agent, peer):
    agent, _ = local_agent
    task = asyncio.create_task(agent.aread_blocks(peer.name, list(range(NUM_BLOCKS)), list(range(NUM_BLOCKS))))
    await asyncio.sleep(0)  # yield once, so that the read starts before it is cancelled
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await agent.aread_blocks(peer.name, [1], [1], timeout_s=10)).ok


def test_unknown_peer_is_a_failed_result(local_agent):
    agent, _ = local_agent
    result = agent.read_blocks("nobody", [0], [0])
    assert result.outcome is TransferOutcome.FAILED and result.error is ErrorCode.NOT_FOUND


def test_bad_block_ids_are_bugs(local_agent, peer):
    agent, _ = local_agent
    with pytest.raises(ValueError):
        agent.read_blocks(peer.name, [0, 1], [0])
    with pytest.raises(ValueError):
        agent.read_blocks(peer.name, [NUM_BLOCKS], [0])
    with pytest.raises(ValueError):
        agent.read_blocks(peer.name, [1, 2], [3, 3])  # two copies into one local block


def test_idle_agent_process_uses_almost_no_cpu(peer):
    # The peer holds a registered pool and a connected peer (this process), and does nothing.
    percent = peer.call("idle_cpu", 2.0)
    assert percent < 5.0, f"an idle KV agent process used {percent:.1f}% of a core"


def test_killed_peer_fails_the_transfer_and_a_restarted_one_is_reachable(local_agent):
    agent, blocks = local_agent
    victim = Peer("victim")
    try:
        agent.add_peer(victim.name, victim.metadata)
        victim.call("add_peer", agent.name, agent.metadata())
        assert agent.read_blocks(victim.name, [0], [0], timeout_s=10).ok
        results = []

        def read_until_failure() -> None:
            def failed() -> bool:
                results.append(agent.read_blocks(victim.name, range(NUM_BLOCKS), range(NUM_BLOCKS), timeout_s=5))
                return not results[-1].ok

            wait_for_sync(failed, 20, "a read from the killed peer to fail", interval_s=0)

        reader = threading.Thread(target=read_until_failure)
        reader.start()
        # Kill while reads are going on: once the first one is back, the next is under way.
        wait_for_sync(lambda: bool(results), 20, "the reader's first read")
        os.kill(victim.process.pid, signal.SIGKILL)
        reader.join(30)
        assert not reader.is_alive()
        assert results[-1].outcome is TransferOutcome.FAILED
        assert results[-1].error in (ErrorCode.DISCONNECTED, ErrorCode.INTERNAL), results[-1]
    finally:
        victim.stop()

    reborn = Peer("victim")  # same name, new process: add_peer must replace the dead one
    try:
        agent.add_peer(reborn.name, reborn.metadata)
        reborn.call("add_peer", agent.name, agent.metadata())
        blocks[:] = 0
        result = agent.read_blocks(reborn.name, [7], [7], timeout_s=10)
        assert result.ok, result
        assert np.array_equal(blocks[7], block_content("victim", 7))
    finally:
        reborn.stop()


def test_removed_peer_is_unreachable_and_close_is_idempotent(peer):
    pool = np.zeros(NUM_BLOCKS * BLOCK_NBYTES, dtype=np.uint8)
    agent = KvAgent("short-lived")
    agent.register_pool(pool, BLOCK_NBYTES)
    agent.add_peer(peer.name, peer.metadata)
    assert agent.read_blocks(peer.name, [1], [1]).ok
    agent.remove_peer(peer.name)
    agent.remove_peer(peer.name)
    assert agent.peers == frozenset()
    assert agent.read_blocks(peer.name, [1], [1]).error is ErrorCode.NOT_FOUND
    agent.close()
    agent.close()
    assert agent.read_blocks(peer.name, [1], [1]).outcome is TransferOutcome.CANCELLED
