"""`KvTransport` between workers of one process: KV blocks copied between numpy pools.

The in-memory counterpart of `connector.nixl_transport.NixlTransport`, chosen by config
(`KvTransferConfig.transport = "memory"`): P/D hand-offs, prefix pulls and push mode work
on a machine without NIXL (a laptop, CI), between workers that share a process.

- A `MemoryFabric` is the "network": the agents registered on it, by agent name. Each
  process has one default fabric (`default_fabric()`); a test may build its own to keep
  its agents apart from everyone else's.
- `metadata()` names the agent, its fabric and its incarnation, like NIXL's metadata names
  its agent; a peer is reachable once `add_peer(name, metadata)` accepted it. Metadata from
  another fabric (another process) is refused with ValueError, as NIXL refuses metadata it
  cannot use. A peer with blocks of another size is accepted, as by `KvAgent`: byte-range
  transfers (`read_ranges` / `write_ranges`) reach it, block transfers to it fail.
- Transfers copy bytes on the transport's own thread (off the event loop, like NIXL's),
  in chunks, checking the deadline between chunks. A peer never added, closed, or
  re-registered under the same name since it was added is a failed result, never an
  exception; a transfer that misses its timeout fails, and its blocks are garbage.
  Ids or ranges outside a pool are caller bugs and raise ValueError.
- `stats` counts transfers as a NIXL agent counts its own (`connector.agent_types.AgentStats`,
  reads and writes apart), so in-memory workers report the same per-rank metrics; a
  transfer's descriptors are the rows it copies (blocks, or ranges after merging).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from connector.agent_types import AgentStats, TransferOp, TransferOutcome
from connector.agent_types import TransferResult as AgentResult
from connector.descriptors import as_block_ids, byte_ranges, check_block_ids, check_ranges, coalesce_ranges
from connector.off_loop import await_transfer
from connector.transport import Offsets, Outcome, TransferResult
from shared.codec import Codec, encode
from shared.schemas.common import Message

_CHUNK_BLOCKS = 64  # blocks copied between two deadline checks
_CHUNK_NBYTES = 1 << 20  # bytes of a range copied between two deadline checks


class MemoryAgentMetadata(Message, kw_only=True):
    """What a memory agent tells its peers (msgpack, like NIXL's metadata over NATS)."""

    agent_name: str
    fabric_id: str
    incarnation: str  # fresh per registration: a peer re-registered under one name differs
    block_nbytes: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class MemoryAgent:
    """One registered pool: `blocks[b]` is block `b`'s bytes."""

    name: str
    incarnation: str
    blocks: np.ndarray  # (num_blocks, block_nbytes) uint8 view of the pool


class MemoryFabric:
    """The agents of one process that can reach each other, by agent name. Thread-safe."""

    def __init__(self) -> None:
        self.fabric_id = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._agents: dict[str, MemoryAgent] = {}

    def register(self, name: str, blocks: np.ndarray) -> MemoryAgent:
        agent = MemoryAgent(name=name, incarnation=uuid.uuid4().hex, blocks=blocks)
        with self._lock:
            self._agents[name] = agent  # a restarted agent replaces its old incarnation
        return agent

    def unregister(self, agent: MemoryAgent) -> None:
        with self._lock:
            if self._agents.get(agent.name) is agent:
                del self._agents[agent.name]

    def lookup(self, name: str) -> MemoryAgent | None:
        with self._lock:
            return self._agents.get(name)

    @property
    def agent_names(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._agents)


_DEFAULT_FABRIC = MemoryFabric()


def default_fabric() -> MemoryFabric:
    """The process's fabric: every memory transport built without one joins it."""
    return _DEFAULT_FABRIC


class MemoryTransport:
    def __init__(self, agent_name: str, buffer: np.ndarray, block_nbytes: int, layer_nbytes: int, *,
                 fabric: MemoryFabric | None = None) -> None:
        if not buffer.flags.c_contiguous:
            raise ValueError("the KV pool must be C-contiguous")
        if block_nbytes <= 0 or buffer.nbytes % block_nbytes:
            raise ValueError(f"pool of {buffer.nbytes} bytes is not a whole number of {block_nbytes}-byte blocks")
        if layer_nbytes <= 0 or block_nbytes % layer_nbytes:
            raise ValueError(f"{block_nbytes}-byte blocks are not whole {layer_nbytes}-byte layers")
        self._fabric = fabric or default_fabric()
        self._blocks = buffer.reshape(-1).view(np.uint8).reshape(-1, block_nbytes)
        self._block_nbytes = block_nbytes
        self._layer_nbytes = layer_nbytes
        self._agent = self._fabric.register(agent_name, self._blocks)
        self._peers: dict[str, MemoryAgentMetadata] = {}
        self._codec: Codec[MemoryAgentMetadata] = Codec(MemoryAgentMetadata)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"kv-memory-{agent_name}")
        self._stats = AgentStats()  # replaced, under the lock, by each transfer
        self._stats_lock = threading.Lock()
        self._closed = False

    @property
    def agent_name(self) -> str:
        return self._agent.name

    @property
    def fabric(self) -> MemoryFabric:
        return self._fabric

    @property
    def stats(self) -> AgentStats:
        """The transfer counters so far (a snapshot: later transfers do not change it)."""
        return self._stats

    def metadata(self) -> bytes:
        return encode(MemoryAgentMetadata(agent_name=self._agent.name, fabric_id=self._fabric.fabric_id,
                                          incarnation=self._agent.incarnation, block_nbytes=self._block_nbytes,
                                          num_blocks=len(self._blocks)))

    def add_peer(self, name: str, metadata: bytes) -> None:
        peer = self._codec.decode(metadata)
        if peer.agent_name != name:
            raise ValueError(f"metadata is for agent {peer.agent_name!r}, not {name!r}")
        if peer.fabric_id != self._fabric.fabric_id:
            raise ValueError(f"agent {name!r} is on another memory fabric (another process?): unreachable")
        self._peers[name] = peer

    def remove_peer(self, name: str) -> None:
        self._peers.pop(name, None)

    def has_peer(self, name: str) -> bool:
        return name in self._peers

    def close(self) -> None:
        """Leave the fabric (peers' transfers to this agent fail from now on) and wait for
        this agent's own transfers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._fabric.unregister(self._agent)
        self._executor.shutdown(wait=True)

    # ---- transfers ----------------------------------------------------------------------

    async def read(self, peer: str, remote_block_ids: list[int], local_block_ids: list[int], *,
                   timeout_s: float) -> TransferResult:
        return await self._transfer(peer, remote_block_ids, local_block_ids, into_local=True,
                                    timeout_s=timeout_s, layer=None)

    async def write(self, peer: str, local_block_ids: list[int], remote_block_ids: list[int], *,
                    timeout_s: float, layer: int | None = None) -> TransferResult:
        return await self._transfer(peer, remote_block_ids, local_block_ids, into_local=False,
                                    timeout_s=timeout_s, layer=layer)

    async def _transfer(self, peer: str, remote_block_ids: list[int], local_block_ids: list[int], *,
                        into_local: bool, timeout_s: float, layer: int | None) -> TransferResult:
        count = len(local_block_ids)
        if len(remote_block_ids) != count:
            raise ValueError(f"{len(remote_block_ids)} remote block ids but {count} local block ids")
        if not count:
            return TransferResult(outcome="done", ok=[])
        op: TransferOp = "READ" if into_local else "WRITE"
        if self._closed:
            return self._count(op, 0, _failed(count, f"memory agent {self.agent_name!r} is closed",
                                              outcome="cancelled"))
        remote_agent, why = self._reachable(peer)
        if remote_agent is None:
            return self._count(op, 0, _failed(count, why))
        if remote_agent.blocks.shape[1] != self._block_nbytes:
            return self._count(op, 0, _failed(
                count, f"peer {peer!r} has {remote_agent.blocks.shape[1]}-byte blocks, this agent "
                       f"{self._block_nbytes}-byte blocks: block ids do not address the same bytes (use byte ranges)"))
        local, remote = as_block_ids(local_block_ids), as_block_ids(remote_block_ids)
        check_block_ids(local, len(self._blocks), "local", unique=into_local)
        check_block_ids(remote, len(remote_agent.blocks), "remote", unique=not into_local)
        if layer is None:
            start, stop = 0, self._block_nbytes
        else:
            start = layer * self._layer_nbytes
            stop = start + self._layer_nbytes
            if layer < 0 or stop > self._block_nbytes:
                raise ValueError(f"layer {layer} is outside a {self._block_nbytes}-byte block")
        source, target = (remote_agent.blocks, self._blocks) if into_local else (self._blocks, remote_agent.blocks)
        source_ids, target_ids = (remote, local) if into_local else (local, remote)
        cancel = threading.Event()
        copy = functools.partial(_copy, source, source_ids, target, target_ids, start, stop,
                                 time.perf_counter() + timeout_s, cancel)
        future = asyncio.get_running_loop().run_in_executor(self._executor, self._counted, op, count, copy)
        return await await_transfer(future, cancel)

    async def read_ranges(self, peer: str, remote_offsets: Offsets, local_offsets: Offsets, lengths: Offsets, *,
                          timeout_s: float) -> TransferResult:
        """Copy `lengths[i]` bytes at `remote_offsets[i]` of the peer's pool to `local_offsets[i]`
        of ours (byte offsets from each pool's start), whatever the peer's block size. One
        flag for the whole transfer (`ok=[True]` or `[False]`), as NIXL reports it."""
        return await self._transfer_ranges(peer, remote_offsets, local_offsets, lengths, into_local=True,
                                           timeout_s=timeout_s)

    async def write_ranges(self, peer: str, remote_offsets: Offsets, local_offsets: Offsets, lengths: Offsets, *,
                           timeout_s: float) -> TransferResult:
        """`read_ranges` the other way: our `local_offsets[i]` to the peer's `remote_offsets[i]`."""
        return await self._transfer_ranges(peer, remote_offsets, local_offsets, lengths, into_local=False,
                                           timeout_s=timeout_s)

    async def _transfer_ranges(self, peer: str, remote_offsets: Offsets, local_offsets: Offsets, lengths: Offsets, *,
                               into_local: bool, timeout_s: float) -> TransferResult:
        ranges = byte_ranges(local_offsets, remote_offsets, lengths)
        if not len(ranges):
            return TransferResult(outcome="done", ok=[True])
        op: TransferOp = "READ" if into_local else "WRITE"
        if self._closed:
            return self._count(op, 0, _failed(1, f"memory agent {self.agent_name!r} is closed", outcome="cancelled"))
        remote_agent, why = self._reachable(peer)
        if remote_agent is None:
            return self._count(op, 0, _failed(1, why))
        local_pool, remote_pool = self._blocks.reshape(-1), remote_agent.blocks.reshape(-1)
        check_ranges(ranges.local_offsets, ranges.lengths, local_pool.size, "local", disjoint=into_local)
        check_ranges(ranges.remote_offsets, ranges.lengths, remote_pool.size, "remote", disjoint=not into_local)
        merged = coalesce_ranges(ranges)
        if into_local:
            copy_args = (remote_pool, merged.remote_offsets, local_pool, merged.local_offsets)
        else:
            copy_args = (local_pool, merged.local_offsets, remote_pool, merged.remote_offsets)
        cancel = threading.Event()
        copy = functools.partial(_copy_ranges, *copy_args, merged.lengths, time.perf_counter() + timeout_s, cancel)
        future = asyncio.get_running_loop().run_in_executor(self._executor, self._counted, op, len(merged.lengths),
                                                            copy)
        return await await_transfer(future, cancel)

    def _counted(self, op: TransferOp, rows: int, copy: Callable[[], TransferResult]) -> TransferResult:
        """Run the copy (on the transport's thread) and count its result, even when the caller
        has stopped waiting for it: the copy ran all the same."""
        return self._count(op, rows, copy())

    def _count(self, op: TransferOp, rows: int, result: TransferResult) -> TransferResult:
        counted = AgentResult(outcome=TransferOutcome(result.outcome), peer="", num_blocks=0, nbytes=result.nbytes,
                              descriptors=rows, elapsed_s=result.duration_s)
        with self._stats_lock:
            self._stats = self._stats.counted(op, counted)
        return result

    def _reachable(self, peer: str) -> tuple[MemoryAgent | None, str]:
        known = self._peers.get(peer)
        if known is None:
            return None, f"unknown peer {peer!r}"
        agent = self._fabric.lookup(peer)
        if agent is None:
            return None, f"peer {peer!r} is gone"
        if agent.incarnation != known.incarnation:
            return None, f"peer {peer!r} restarted since it was added"
        return agent, ""


def _failed(count: int, reason: str, *, outcome: Outcome = "failed") -> TransferResult:
    return TransferResult(outcome=outcome, ok=[False] * count, reason=reason)


def _copy(source: np.ndarray, source_ids: np.ndarray, target: np.ndarray, target_ids: np.ndarray,
          start: int, stop: int, deadline: float, cancel: threading.Event) -> TransferResult:
    """Copy bytes [start, stop) of each source block into its target block, chunk by chunk."""
    began = time.perf_counter()
    count = int(source_ids.size)
    for first in range(0, count, _CHUNK_BLOCKS):
        if cancel.is_set():
            return _failed(count, "cancelled by the caller", outcome="cancelled")
        if time.perf_counter() > deadline:
            return _failed(count, "transfer not complete in time")
        chunk = slice(first, first + _CHUNK_BLOCKS)
        target[target_ids[chunk], start:stop] = source[source_ids[chunk], start:stop]
    return TransferResult(outcome="done", ok=[True] * count, nbytes=count * (stop - start),
                          duration_s=time.perf_counter() - began)



def _copy_ranges(source: np.ndarray, source_offsets: np.ndarray, target: np.ndarray, target_offsets: np.ndarray,
                 lengths: np.ndarray, deadline: float, cancel: threading.Event) -> TransferResult:
    """Copy each range of the flat source pool into the flat target pool, at most
    `_CHUNK_NBYTES` between two checks of the deadline and of cancellation."""
    began = time.perf_counter()
    for source_offset, target_offset, length in zip(source_offsets.tolist(), target_offsets.tolist(),
                                                    lengths.tolist()):
        for done in range(0, length, _CHUNK_NBYTES):
            if cancel.is_set():
                return _failed(1, "cancelled by the caller", outcome="cancelled")
            if time.perf_counter() > deadline:
                return _failed(1, "transfer not complete in time")
            piece = min(_CHUNK_NBYTES, length - done)
            target[target_offset + done:target_offset + done + piece] = \
                source[source_offset + done:source_offset + done + piece]
    return TransferResult(outcome="done", ok=[True], nbytes=int(lengths.sum()), duration_s=time.perf_counter() - began)
