"""Prepared per-block descriptor lists of a KvAgent's pool and of each peer's: made once (the
pool's at registration, a peer's when it is added), so that a whole-block transfer names
block indices (`makeXferReq`) instead of building and resolving descriptors each time
(`createXferReq`). NIXL merges adjacent blocks itself. On a GPU a small transfer is done in
tens of microseconds, so what a transfer costs the CPU before its post is what it costs.

A peer's list is released when the peer is forgotten, or, if transfers still use it, when
the last of them ends: a handle is never released under a running transfer. Thread-safe
(the agent's executor threads take lists while its loop thread adds and removes peers).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from connector.agent_types import PoolInfo
from connector.descriptors import run_descriptors


def block_rows(pool: PoolInfo) -> np.ndarray:
    """One descriptor row (address, length, device_id) per block of the pool, in block order."""
    blocks = np.arange(pool.num_blocks, dtype=np.int64)
    return run_descriptors(pool.base_addr, pool.block_nbytes, blocks, np.ones_like(blocks), pool.device_id)


class BlockDlists:
    def __init__(self, agent: Any, nixl: Any, errors: tuple[type[Exception], ...]) -> None:
        self._agent, self._nixl, self._errors = agent, nixl, errors
        self._lock = threading.Lock()
        self._local: int | None = None
        self._peers: dict[str, int] = {}
        self._users: dict[int, int] = {}  # handle -> transfers using it now
        self._retired: set[int] = set()  # forgotten peers' handles still in use

    def _prepare(self, owner: Any, pool: PoolInfo) -> int:
        segment = self._nixl.VRAM_SEG if pool.mem_type == "VRAM" else self._nixl.DRAM_SEG
        return self._agent.prepXferDlist(owner, self._nixl.nixlXferDList(segment, block_rows(pool)), [])

    def prepare_local(self, pool: PoolInfo) -> None:
        handle = self._prepare(self._nixl.NIXL_INIT_AGENT, pool)
        with self._lock:
            self._local = handle

    def prepare_peer(self, name: str, pool: PoolInfo) -> None:
        """After NIXL has the peer's metadata; a list already made for that name is forgotten."""
        handle = self._prepare(name, pool)
        self.forget_peer(name)
        with self._lock:
            self._peers[name] = handle

    def take(self, peer: str) -> tuple[int, int] | None:
        """(local list, peer's list) for one transfer, or None for a peer without one; hand
        the peer's back with `give_back` when the transfer has ended."""
        with self._lock:
            remote = self._peers.get(peer)
            if remote is None or self._local is None:
                return None
            self._users[remote] = self._users.get(remote, 0) + 1
            return self._local, remote

    def give_back(self, remote: int) -> None:
        with self._lock:
            users = self._users.pop(remote) - 1
            if users:
                self._users[remote] = users
                return
            if remote not in self._retired:
                return
            self._retired.discard(remote)
        self._release(remote)

    def forget_peer(self, name: str) -> None:
        with self._lock:
            handle = self._peers.pop(name, None)
            if handle is None:
                return
            if self._users.get(handle):
                self._retired.add(handle)
                return
        self._release(handle)

    def close(self) -> None:
        """Release every list (the agent's transfers have ended)."""
        with self._lock:
            handles = [*self._peers.values(), *self._retired]
            if self._local is not None:
                handles.append(self._local)
            self._peers, self._retired, self._users, self._local = {}, set(), {}, None
        for handle in handles:
            self._release(handle)

    def _release(self, handle: int) -> None:
        try:
            self._agent.releasedDlistH(handle)
        except self._errors:
            pass  # the agent is going away: NIXL frees what is left with it
