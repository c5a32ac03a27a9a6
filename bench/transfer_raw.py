"""Straight NIXL calls, the baseline of the transfer bench: on a `KvAgent`'s own bindings agent
and connection, so the connector and the baseline differ only in the call pattern.

- `transfer`: one descriptor per block (descriptor lists -> createXferReq -> post -> poll ->
  release);
- `transfer_prepped`: descriptor lists prepared once per side, then makeXferReq with block
  indices per transfer (NIXL merges adjacent descriptors itself).
Both poll without sleeping, as a caller that holds a core for the transfer does. And an
agent built by NIXL's Python API with its defaults, whose idle CPU the bench reports beside
the connector's.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Literal

import numpy as np

from connector.agent_types import PoolInfo
from connector.nixl_agent import KvAgent, load_nixl

Op = Literal["READ", "WRITE"]


class RawNixl:
    def __init__(self, agent: KvAgent, peer: str) -> None:
        self.nixl = load_nixl()
        self.agent = agent.nixl_agent
        self.peer = peer
        self.local = agent.pool
        remote = agent.peer_pool(peer)
        assert remote is not None
        self.remote = remote
        self.prepped: tuple[int, int] | None = None

    def _segment(self, pool: PoolInfo) -> Any:
        return self.nixl.VRAM_SEG if pool.mem_type == "VRAM" else self.nixl.DRAM_SEG

    def _rows(self, pool: PoolInfo, block_ids: np.ndarray) -> np.ndarray:
        rows = np.zeros((block_ids.size, 3), dtype=np.uint64)
        rows[:, 0] = pool.base_addr + block_ids.astype(np.uint64) * pool.block_nbytes
        rows[:, 1] = pool.block_nbytes
        rows[:, 2] = pool.device_id
        return rows

    def _descriptors(self, pool: PoolInfo, block_ids: np.ndarray) -> Any:
        return self.nixl.nixlXferDList(self._segment(pool), self._rows(pool, block_ids))

    def _operation(self, op: Op) -> Any:
        return self.nixl.NIXL_READ if op == "READ" else self.nixl.NIXL_WRITE

    def _wait(self, handle: int) -> None:
        nixl = self.nixl
        status = self.agent.postXferReq(handle)
        while status == nixl.NIXL_IN_PROG:
            status = self.agent.getXferStatus(handle)
        self.agent.releaseXferReq(handle)
        assert status == nixl.NIXL_SUCCESS, status

    def transfer(self, op: Op, remote_ids: np.ndarray, local_ids: np.ndarray) -> None:
        handle = self.agent.createXferReq(
            self._operation(op), self._descriptors(self.local, local_ids),
            self._descriptors(self.remote, remote_ids), self.peer, "", [])
        self._wait(handle)

    def transfer_prepped(self, op: Op, remote_ids: np.ndarray, local_ids: np.ndarray) -> None:
        if self.prepped is None:  # once per peer, as a serving system would
            local = self.agent.prepXferDlist(
                self.nixl.NIXL_INIT_AGENT, self._descriptors(self.local, np.arange(self.local.num_blocks)), [])
            remote = self.agent.prepXferDlist(
                self.peer, self._descriptors(self.remote, np.arange(self.remote.num_blocks)), [])
            self.prepped = (local, remote)
        local, remote = self.prepped
        handle = self.agent.makeXferReq(self._operation(op), local, local_ids.astype(np.int32), remote,
                                        remote_ids.astype(np.int32), "", [], False)
        self._wait(handle)

    def close(self) -> None:
        if self.prepped is not None:
            for handle in self.prepped:
                self.agent.releasedDlistH(handle)
            self.prepped = None


def _stock_agent_main(conn: Connection, num_blocks: int, block_nbytes: int, seconds: float,
                      idle_cpu_percent: Callable[[float], float]) -> None:
    """An agent built the way NIXL's Python API builds it by default, for comparison."""
    api = importlib.import_module(load_nixl().__name__.rsplit(".", 1)[0] + "._api")
    api.logger.setLevel(logging.WARNING)  # its INFO lines go to stdout, into the JSON
    pool = np.zeros(num_blocks * block_nbytes, dtype=np.uint8)
    agent = api.nixl_agent("bench-stock")
    registration = agent.register_memory([(pool.ctypes.data, pool.nbytes, 0, "")], "DRAM")
    conn.send(idle_cpu_percent(seconds))
    agent.deregister_memory(registration)


def stock_agent_idle_cpu(context: Any, seconds: float, idle_cpu_percent: Callable[[float], float]) -> float:
    """The idle CPU (% of a core) of a process holding an agent as NIXL's Python API builds it
    by default (its progress thread polls without sleeping), measured by `idle_cpu_percent`."""
    conn, child_conn = context.Pipe()
    process = context.Process(target=_stock_agent_main, args=(child_conn, 64, 4096, seconds, idle_cpu_percent), daemon=True)
    process.start()
    try:
        if not conn.poll(seconds + 60):
            raise RuntimeError("the stock-agent process did not report")
        return conn.recv()
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join()
