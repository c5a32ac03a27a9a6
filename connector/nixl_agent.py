"""KvAgent: one NIXL agent per worker, moving KV blocks and byte ranges between registered pools.

Called by the worker's transfer protocol (leases, pull and push, through `NixlTransport`)
and by the worker side of the vLLM connector. Lifecycle: `KvAgent(name, config)` ->
`register_pool(buffer, block_nbytes)` once -> `metadata()` goes to peers over NATS -> each
peer calls `add_peer(name, metadata)` -> transfers -> `close()`.

- `read_blocks` / `write_blocks` / `write_layer` address blocks by id, so they need a peer
  with blocks of this agent's size (else a failed result); whole blocks travel by index into
  descriptor lists prepared once (`connector.block_dlists`). `read_ranges` / `write_ranges`
  take byte offsets into each pool and reach any peer (workers of unlike shapes).
- Transfers block the calling thread (the event loop uses the `a*` wrappers, which run them
  on the agent's executor): NIXL copies from DRAM inside the posting call (UCX over CMA on
  one host), and one from GPU memory is polled for (`KvAgentConfig.vram_spin_us`).
- Every transfer returns a `TransferResult` (done, failed, cancelled), counted in `stats`; a
  NIXL error (e.g. the peer died mid-transfer) is a failed result, never an exception. The
  timeout bounds the wait for completion; a copy inside the posting call, its size.
  Wrong arguments (ids or ranges outside a pool, mismatched lengths) are bugs: ValueError.
- NIXL is driven through its pybind bindings rather than `nixl_agent`, whose constructor
  hardcodes a zero progress-thread delay (a spinning core per agent): see KvAgentConfig.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from connector.agent_types import (
    AgentMetadata,
    AgentStats,
    KvAgentConfig,
    PoolInfo,
    TransferOp,
    TransferOutcome,
    TransferResult,
)
from connector.block_dlists import BlockDlists
from connector.descriptors import Ints, TransferPlan, plan_blocks, plan_ranges, plan_whole_blocks
from connector.nixl_runtime import allow_cuda_ipc_reads, load_nixl, nixl_available
from connector.off_loop import await_transfer
from connector.progress_threads import released_from_binding
from connector.xfer_requests import XferRequests, segment
from shared.codec import Codec, encode
from shared.errors import ErrorCode

__all__ = ["KvAgent", "load_nixl", "nixl_available"]  # the runtime's, where callers look for them

log = logging.getLogger(__name__)

Planner = Callable[[PoolInfo, PoolInfo], TransferPlan]  # (local pool, peer's pool) -> rows

class KvAgent:
    def __init__(self, name: str, config: KvAgentConfig | None = None) -> None:
        self.config = config or KvAgentConfig()
        self.config.validate()
        self.name = name
        self._nixl = nixl = load_nixl()
        # Bindings raise their own exception classes, with no common base but Exception.
        self._nixl_errors = tuple(getattr(nixl, n) for n in dir(nixl)
                                  if n.startswith("nixl") and n.endswith("Error"))
        agent_config = nixl.nixlAgentConfig()
        agent_config.useProgThread = True
        agent_config.pthrDelay = self.config.progress_delay_us
        agent_config.useListenThread = False  # metadata travels over NATS
        # Transfers run on executor threads while the loop thread adds and removes peers.
        agent_config.syncMode = nixl.NIXL_THREAD_SYNC_RW
        self._agent = nixl.nixlAgent(name, agent_config)
        self._executor = ThreadPoolExecutor(self.config.transfer_threads, thread_name_prefix=f"kv-agent-{name}")
        self._lock = threading.Lock()
        self._pool: PoolInfo | None = None
        self._registration: Any = None
        self._buffer: Any = None  # keeps the registered memory alive
        self._peers: dict[str, PoolInfo] = {}
        self._stats = AgentStats()  # replaced, under the lock, by each transfer
        self._closed = False
        self._codec: Codec[AgentMetadata] = Codec(AgentMetadata)
        self._dlists = BlockDlists(self._agent, nixl, self._nixl_errors)
        self._requests = XferRequests(self._agent, nixl, self._nixl_errors, self._dlists, self.config)

    # ---- pool and peers (control plane) ----

    @property
    def pool(self) -> PoolInfo:
        if self._pool is None:
            raise RuntimeError("register_pool() first")
        return self._pool

    @property
    def peers(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._peers)

    @property
    def stats(self) -> AgentStats:
        """The transfer counters so far (a snapshot: later transfers do not change it)."""
        with self._lock:
            return self._stats

    @property
    def nixl_agent(self) -> Any:
        """The underlying bindings agent, for benchmarks and diagnostics only."""
        return self._agent

    def register_pool(self, buffer: Any, block_nbytes: int) -> PoolInfo:
        """Register the whole KV pool as one NIXL region: C-contiguous host memory (a numpy
        array), or GPU memory (anything with `__cuda_array_interface__`, e.g. a torch CUDA
        tensor of uint8, registered as VRAM on the tensor's device)."""
        self._check_open()
        if self._pool is not None:
            raise RuntimeError("a pool is already registered")
        pool = PoolInfo.of(buffer, block_nbytes)
        # The backends start with the pool: UCX's settings for GPU memory are made before it does.
        if "UCX" in self.config.backends:
            allow_cuda_ipc_reads(self.name, self.config.cuda_ipc_reads, pool.mem_type)
        with released_from_binding():  # the backend's progress thread: any core (progress_threads)
            for backend in self.config.backends:
                self._agent.createBackend(backend, {})
        registration = self._nixl.nixlRegDList(segment(self._nixl, pool.mem_type),
                                               [(pool.base_addr, pool.nbytes, pool.device_id, "")])
        self._agent.registerMem(registration, [])
        self._pool, self._registration, self._buffer = pool, registration, buffer
        self._dlists.prepare_local(pool)
        return pool

    def metadata(self) -> bytes:
        """This agent's metadata for peers; includes the registered pool, so call it after
        `register_pool`."""
        return encode(AgentMetadata(agent_name=self.name, nixl_metadata=self._agent.getLocalMD(), pool=self.pool))

    def add_peer(self, name: str, metadata: bytes) -> None:
        """Make `name` reachable. A peer already known under that name (a restarted worker)
        is forgotten first: NIXL would otherwise keep the dead incarnation's connection. A peer
        with blocks of another size is reachable by byte ranges; block transfers to it fail."""
        self._check_open()
        peer = self._codec.decode(metadata)
        if peer.agent_name != name:
            raise ValueError(f"metadata is for agent {peer.agent_name!r}, not {name!r}")
        with self._lock:
            if name in self._peers:
                self._forget(name)
            loaded = self._agent.loadRemoteMD(peer.nixl_metadata)
            if isinstance(loaded, bytes):
                loaded = loaded.decode()
            assert loaded == name, (loaded, name)
            self._dlists.prepare_peer(name, peer.pool)
            self._peers[name] = peer.pool

    def remove_peer(self, name: str) -> None:
        """Forget a peer and disconnect from it. Unknown names are ignored."""
        with self._lock:
            if name in self._peers:
                self._forget(name)

    def peer_pool(self, name: str) -> PoolInfo | None:
        with self._lock:
            return self._peers.get(name)

    def _forget(self, name: str) -> None:
        del self._peers[name]
        self._dlists.forget_peer(name)
        try:
            self._agent.invalidateRemoteMD(name)
        except self._nixl_errors:
            pass  # already gone on NIXL's side: the outcome we wanted

    def take_notifications(self) -> dict[str, list[bytes]]:
        """Notifications peers attached to their writes (`notify=`), by peer name."""
        self._check_open()
        return self._agent.getNotifs({}, [])

    # ---- transfers (data plane) ----

    def read_blocks(self, peer: str, remote_block_ids: Ints, local_block_ids: Ints, *,
                    timeout_s: float | None = None, cancel: threading.Event | None = None) -> TransferResult:
        """Copy the peer's blocks into ours: remote_block_ids[i] -> local_block_ids[i]."""
        plan = functools.partial(plan_whole_blocks, local_ids=local_block_ids, remote_ids=remote_block_ids,
                                 into_local=True)
        return self._transfer("READ", peer, plan, timeout_s, cancel, b"")

    def write_blocks(self, peer: str, remote_block_ids: Ints, local_block_ids: Ints, *,
                     timeout_s: float | None = None, cancel: threading.Event | None = None,
                     notify: bytes = b"") -> TransferResult:
        """Copy our blocks into the peer's: local_block_ids[i] -> remote_block_ids[i].
        `notify` reaches the peer's `take_notifications()` once the data has landed."""
        plan = functools.partial(plan_whole_blocks, local_ids=local_block_ids, remote_ids=remote_block_ids,
                                 into_local=False)
        return self._transfer("WRITE", peer, plan, timeout_s, cancel, notify)

    def write_layer(self, peer: str, remote_block_ids: Ints, local_block_ids: Ints, *,
                    layer_offset: int, layer_nbytes: int, timeout_s: float | None = None,
                    cancel: threading.Event | None = None, notify: bytes = b"") -> TransferResult:
        """Push mode: write one layer, bytes [layer_offset, layer_offset + layer_nbytes) of
        each block, as soon as it is computed, overlapping the transfer with the next layers."""
        plan = functools.partial(plan_blocks, local_ids=local_block_ids, remote_ids=remote_block_ids, into_local=False,
                                 offset=layer_offset, length=layer_nbytes)
        return self._transfer("WRITE", peer, plan, timeout_s, cancel, notify)

    def read_ranges(self, peer: str, remote_offsets: Ints, local_offsets: Ints, lengths: Ints, *,
                    timeout_s: float | None = None, cancel: threading.Event | None = None) -> TransferResult:
        """Copy `lengths[i]` bytes at `remote_offsets[i]` of the peer's pool to `local_offsets[i]` of
        ours, whatever the peer's block size. Rows adjacent on both sides, in the given order,
        travel as one descriptor. ValueError for a row outside its pool or overlapping local rows."""
        plan = functools.partial(plan_ranges, local_offsets=local_offsets, remote_offsets=remote_offsets,
                                 lengths=lengths, into_local=True)
        return self._transfer("READ", peer, plan, timeout_s, cancel, b"")

    def write_ranges(self, peer: str, remote_offsets: Ints, local_offsets: Ints, lengths: Ints, *,
                     timeout_s: float | None = None, cancel: threading.Event | None = None,
                     notify: bytes = b"") -> TransferResult:
        """`read_ranges` the other way (the peer's rows must not overlap); `notify` as in
        `write_blocks`."""
        plan = functools.partial(plan_ranges, local_offsets=local_offsets, remote_offsets=remote_offsets,
                                 lengths=lengths, into_local=False)
        return self._transfer("WRITE", peer, plan, timeout_s, cancel, notify)

    async def aread_blocks(self, peer: str, remote_block_ids: Ints, local_block_ids: Ints, *,
                           timeout_s: float | None = None) -> TransferResult:
        return await self._off_loop(self.read_blocks, peer, remote_block_ids, local_block_ids, timeout_s=timeout_s)

    async def awrite_blocks(self, peer: str, remote_block_ids: Ints, local_block_ids: Ints, *,
                            timeout_s: float | None = None, notify: bytes = b"") -> TransferResult:
        return await self._off_loop(self.write_blocks, peer, remote_block_ids, local_block_ids, timeout_s=timeout_s,
                                    notify=notify)

    async def awrite_layer(self, peer: str, remote_block_ids: Ints, local_block_ids: Ints, *,
                           layer_offset: int, layer_nbytes: int, timeout_s: float | None = None,
                           notify: bytes = b"") -> TransferResult:
        return await self._off_loop(self.write_layer, peer, remote_block_ids, local_block_ids, timeout_s=timeout_s,
                                    layer_offset=layer_offset, layer_nbytes=layer_nbytes, notify=notify)

    async def aread_ranges(self, peer: str, remote_offsets: Ints, local_offsets: Ints, lengths: Ints, *,
                           timeout_s: float | None = None) -> TransferResult:
        return await self._off_loop(self.read_ranges, peer, remote_offsets, local_offsets, lengths, timeout_s=timeout_s)

    async def awrite_ranges(self, peer: str, remote_offsets: Ints, local_offsets: Ints, lengths: Ints, *,
                            timeout_s: float | None = None, notify: bytes = b"") -> TransferResult:
        return await self._off_loop(self.write_ranges, peer, remote_offsets, local_offsets, lengths,
                                    timeout_s=timeout_s, notify=notify)

    async def _off_loop(self, transfer: Any, *args: Any, **kwargs: Any) -> TransferResult:
        cancel = threading.Event()
        call = functools.partial(transfer, *args, cancel=cancel, **kwargs)
        try:
            future = asyncio.get_running_loop().run_in_executor(self._executor, call)
        except RuntimeError:  # the executor is shut down: close() ran, the result says so
            return call()
        return await await_transfer(future, cancel)

    def _transfer(self, op: TransferOp, peer: str, plan: Planner, timeout_s: float | None,
                  cancel: threading.Event | None, notify: bytes) -> TransferResult:
        """Every transfer's one path: plan rows against both pools, post and wait
        (`XferRequests.post`, connector.xfer_requests), count in `stats`."""
        started = time.perf_counter()
        if self._closed:  # queued behind close(): expected during shutdown, not a bug
            result = TransferResult.refused(peer, TransferOutcome.CANCELLED, ErrorCode.CANCELLED,
                                            f"KV agent {self.name!r} is closed")
        elif (peer_pool := self.peer_pool(peer)) is None:
            result = TransferResult.refused(peer, TransferOutcome.FAILED, ErrorCode.NOT_FOUND, f"unknown peer {peer!r}")
        else:
            result = self._requests.post(op, peer, self.pool, peer_pool, plan(self.pool, peer_pool), started,
                                         timeout_s, cancel, notify)
        with self._lock:
            self._stats = self._stats.counted(op, result)
        return result

    # ---- shutdown ----

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"KV agent {self.name!r} is closed")

    def close(self) -> None:
        """Wait for in-flight transfers (bounded by their timeouts), disconnect from every
        peer, deregister the pool and destroy the NIXL agent. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        with self._lock:
            for name in list(self._peers):
                self._forget(name)
        self._requests.close()
        self._dlists.close()
        if self._registration is not None:
            self._agent.deregisterMem(self._registration, [])
            self._registration = None
        self._agent = None  # the bindings' destructor joins NIXL's threads
        self._buffer = None

    def __enter__(self) -> KvAgent:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
