"""KvAgent: one NIXL agent per worker, moving KV blocks between registered pools.

Called by the worker's transfer protocol (leases, pull and push) and, later, by the worker
side of the vLLM connector. Lifecycle: `KvAgent(name, config)` -> `register_pool(buffer,
block_nbytes)` once -> `metadata()` goes to peers over NATS -> each peer calls
`add_peer(name, metadata)` -> transfers -> `close()`.

- `read_blocks` / `write_blocks` / `write_layer` block the calling thread: NIXL performs the
  copy inside the posting call (UCX over CMA on one host). The event loop uses the `a*`
  wrappers, which run them on the agent's own executor.
- Every transfer returns a `TransferResult` (done, failed, cancelled) with bounded waits; a
  NIXL error (e.g. the peer died mid-transfer) is a failed result, never an exception. The
  timeout bounds the wait for completion; a copy done inside the posting call (CMA) is
  bounded by its size instead.
  Wrong arguments (ids out of range, mismatched lengths) are bugs and raise ValueError.
- NIXL is driven through its pybind bindings rather than `nixl_agent`, whose constructor
  hardcodes a zero progress-thread delay (a spinning core per agent): see KvAgentConfig.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import numpy as np

from connector.agent_types import AgentMetadata, KvAgentConfig, PoolInfo, TransferOutcome, TransferResult
from connector.descriptors import as_block_ids, check_block_ids, coalesce_block_runs, run_descriptors
from connector.off_loop import await_transfer
from shared.codec import Codec, encode
from shared.errors import ErrorCode

BlockIds = Sequence[int] | np.ndarray

# The CUDA-variant wheels (nixl-cu12, nixl-cu13) each ship the same bindings under their own
# name; the `nixl` meta package re-exports one of them.
_BINDING_MODULES = ("nixl_cu12._bindings", "nixl_cu13._bindings", "nixl._bindings")


@functools.cache
def load_nixl() -> ModuleType:
    errors = []
    for name in _BINDING_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as error:
            errors.append(f"{name}: {error}")
    raise ImportError("NIXL is not installed (pip install nixl-cu12): " + "; ".join(errors))


def nixl_available() -> bool:
    try:
        load_nixl()
    except ImportError:
        return False
    return True


def _region(buffer: Any) -> tuple[int, int, str, int]:
    """(address, bytes, "DRAM" or "VRAM", device id) of a contiguous pool buffer."""
    cuda = getattr(buffer, "__cuda_array_interface__", None)
    if cuda is None:
        if not isinstance(buffer, np.ndarray) or not buffer.flags.c_contiguous:
            raise ValueError("the KV pool must be a C-contiguous numpy array or a contiguous CUDA array")
        return buffer.ctypes.data, buffer.nbytes, "DRAM", 0
    if cuda.get("strides") is not None:  # None means C-contiguous in the interface
        raise ValueError("the KV pool must be contiguous")
    nbytes = int(np.prod(cuda["shape"])) * np.dtype(cuda["typestr"]).itemsize
    device = getattr(buffer, "device", None)
    return int(cuda["data"][0]), nbytes, "VRAM", int(getattr(device, "index", None) or 0)


def _error_code(nixl: ModuleType, error: Exception) -> ErrorCode:
    if isinstance(error, nixl.nixlRemoteDisconnectError):
        return ErrorCode.DISCONNECTED
    if isinstance(error, nixl.nixlNotFoundError):
        return ErrorCode.NOT_FOUND
    if isinstance(error, nixl.nixlCancelledError):
        return ErrorCode.CANCELLED
    return ErrorCode.INTERNAL


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
        for backend in self.config.backends:
            self._agent.createBackend(backend, {})
        self._executor = ThreadPoolExecutor(self.config.transfer_threads, thread_name_prefix=f"kv-agent-{name}")
        self._lock = threading.Lock()
        self._pool: PoolInfo | None = None
        self._registration: Any = None
        self._buffer: Any = None  # keeps the registered memory alive
        self._peers: dict[str, PoolInfo] = {}
        self._unreleased: list[int] = []  # transfer handles NIXL refused to release
        self._closed = False
        self._codec: Codec[AgentMetadata] = Codec(AgentMetadata)

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
        base_addr, nbytes, mem_type, device_id = _region(buffer)
        if block_nbytes <= 0 or nbytes % block_nbytes:
            raise ValueError(f"pool of {nbytes} bytes is not a whole number of {block_nbytes}-byte blocks")
        pool = PoolInfo(base_addr=base_addr, block_nbytes=block_nbytes, num_blocks=nbytes // block_nbytes,
                        mem_type=mem_type, device_id=device_id)
        registration = self._nixl.nixlRegDList(self._segment(mem_type),
                                               [(pool.base_addr, pool.nbytes, pool.device_id, "")])
        self._agent.registerMem(registration, [])
        self._pool, self._registration, self._buffer = pool, registration, buffer
        return pool

    def _segment(self, mem_type: str) -> Any:
        return self._nixl.VRAM_SEG if mem_type == "VRAM" else self._nixl.DRAM_SEG

    def metadata(self) -> bytes:
        """This agent's metadata for peers; includes the registered pool, so call it after
        `register_pool`."""
        return encode(AgentMetadata(agent_name=self.name, nixl_metadata=self._agent.getLocalMD(), pool=self.pool))

    def add_peer(self, name: str, metadata: bytes) -> None:
        """Make `name` reachable. A peer already known under that name (a restarted worker)
        is forgotten first: NIXL would otherwise keep the dead incarnation's connection."""
        self._check_open()
        peer = self._codec.decode(metadata)
        if peer.agent_name != name:
            raise ValueError(f"metadata is for agent {peer.agent_name!r}, not {name!r}")
        if peer.pool.block_nbytes != self.pool.block_nbytes:
            raise ValueError(f"peer {name!r} has {peer.pool.block_nbytes}-byte blocks, "
                             f"this agent {self.pool.block_nbytes}-byte blocks")
        with self._lock:
            if name in self._peers:
                self._forget(name)
            loaded = self._agent.loadRemoteMD(peer.nixl_metadata)
            if isinstance(loaded, bytes):
                loaded = loaded.decode()
            assert loaded == name, (loaded, name)
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
        try:
            self._agent.invalidateRemoteMD(name)
        except self._nixl_errors:
            pass  # already gone on NIXL's side: the outcome we wanted

    def take_notifications(self) -> dict[str, list[bytes]]:
        """Notifications peers attached to their writes (`notify=`), by peer name."""
        self._check_open()
        return self._agent.getNotifs({}, [])

    # ---- transfers (data plane) ----

    def read_blocks(self, peer: str, remote_block_ids: BlockIds, local_block_ids: BlockIds, *,
                    timeout_s: float | None = None, cancel: threading.Event | None = None) -> TransferResult:
        """Copy the peer's blocks into ours: remote_block_ids[i] -> local_block_ids[i]."""
        return self._transfer("READ", peer, remote_block_ids, local_block_ids, 0, None,
                              timeout_s, cancel, b"")

    def write_blocks(self, peer: str, remote_block_ids: BlockIds, local_block_ids: BlockIds, *,
                     timeout_s: float | None = None, cancel: threading.Event | None = None,
                     notify: bytes = b"") -> TransferResult:
        """Copy our blocks into the peer's: local_block_ids[i] -> remote_block_ids[i].
        `notify` reaches the peer's `take_notifications()` once the data has landed."""
        return self._transfer("WRITE", peer, remote_block_ids, local_block_ids, 0, None,
                              timeout_s, cancel, notify)

    def write_layer(self, peer: str, remote_block_ids: BlockIds, local_block_ids: BlockIds, *,
                    layer_offset: int, layer_nbytes: int, timeout_s: float | None = None,
                    cancel: threading.Event | None = None, notify: bytes = b"") -> TransferResult:
        """Push mode: write one layer, bytes [layer_offset, layer_offset + layer_nbytes) of
        each block, as soon as it is computed, overlapping the transfer with the next layers."""
        return self._transfer("WRITE", peer, remote_block_ids, local_block_ids, layer_offset,
                              layer_nbytes, timeout_s, cancel, notify)

    async def aread_blocks(self, peer: str, remote_block_ids: BlockIds, local_block_ids: BlockIds, *,
                           timeout_s: float | None = None) -> TransferResult:
        return await self._off_loop(self.read_blocks, peer, remote_block_ids, local_block_ids, timeout_s=timeout_s)

    async def awrite_blocks(self, peer: str, remote_block_ids: BlockIds, local_block_ids: BlockIds, *,
                            timeout_s: float | None = None, notify: bytes = b"") -> TransferResult:
        return await self._off_loop(self.write_blocks, peer, remote_block_ids, local_block_ids,
                                    timeout_s=timeout_s, notify=notify)

    async def awrite_layer(self, peer: str, remote_block_ids: BlockIds, local_block_ids: BlockIds, *,
                           layer_offset: int, layer_nbytes: int, timeout_s: float | None = None,
                           notify: bytes = b"") -> TransferResult:
        return await self._off_loop(self.write_layer, peer, remote_block_ids, local_block_ids,
                                    layer_offset=layer_offset, layer_nbytes=layer_nbytes,
                                    timeout_s=timeout_s, notify=notify)

    async def _off_loop(self, transfer: Any, *args: Any, **kwargs: Any) -> TransferResult:
        cancel = threading.Event()
        call = functools.partial(transfer, *args, cancel=cancel, **kwargs)
        try:
            future = asyncio.get_running_loop().run_in_executor(self._executor, call)
        except RuntimeError:  # the executor is shut down: close() ran, the result says so
            return call()
        return await await_transfer(future, cancel)

    def _transfer(self, op: str, peer: str, remote_block_ids: BlockIds, local_block_ids: BlockIds,
                  offset: int, length: int | None, timeout_s: float | None,
                  cancel: threading.Event | None, notify: bytes) -> TransferResult:
        if self._closed:  # queued behind close(): expected during shutdown, not a bug
            return TransferResult(outcome=TransferOutcome.CANCELLED, peer=peer, num_blocks=0, nbytes=0,
                                  descriptors=0, elapsed_s=0.0, error=ErrorCode.CANCELLED,
                                  detail=f"KV agent {self.name!r} is closed")
        started = time.perf_counter()
        local, remote = as_block_ids(local_block_ids), as_block_ids(remote_block_ids)
        if local.size != remote.size:
            raise ValueError(f"{remote.size} remote block ids but {local.size} local block ids")
        pool = self.pool
        peer_pool = self.peer_pool(peer)
        if peer_pool is None:
            return TransferResult(outcome=TransferOutcome.FAILED, peer=peer, num_blocks=int(local.size),
                                  nbytes=0, descriptors=0, elapsed_s=0.0, error=ErrorCode.NOT_FOUND,
                                  detail=f"unknown peer {peer!r}")
        check_block_ids(local, pool.num_blocks, "local", unique=op == "READ")
        check_block_ids(remote, peer_pool.num_blocks, "remote", unique=op == "WRITE")
        runs = coalesce_block_runs(local, remote)
        local_rows = run_descriptors(pool.base_addr, pool.block_nbytes, runs.local_starts, runs.counts,
                                     pool.device_id, offset=offset, length=length)
        remote_rows = run_descriptors(peer_pool.base_addr, peer_pool.block_nbytes, runs.remote_starts,
                                      runs.counts, peer_pool.device_id, offset=offset, length=length)
        result = functools.partial(TransferResult, peer=peer, num_blocks=int(local.size),
                                   nbytes=int(local_rows[:, 1].sum()), descriptors=len(local_rows))
        deadline = started + (timeout_s if timeout_s is not None else self.config.default_timeout_s)
        if local.size == 0:
            return result(outcome=TransferOutcome.DONE, elapsed_s=0.0)
        nixl = self._nixl
        handle = None
        try:
            handle = self._agent.createXferReq(
                nixl.NIXL_READ if op == "READ" else nixl.NIXL_WRITE,
                nixl.nixlXferDList(self._segment(pool.mem_type), local_rows),
                nixl.nixlXferDList(self._segment(peer_pool.mem_type), remote_rows),
                peer, notify, [])
            status = self._agent.postXferReq(handle)
            pause = 20e-6
            while status == nixl.NIXL_IN_PROG:
                if cancel is not None and cancel.is_set():
                    return result(outcome=TransferOutcome.CANCELLED, elapsed_s=time.perf_counter() - started,
                                  error=ErrorCode.CANCELLED, detail="cancelled by the caller")
                if time.perf_counter() > deadline:
                    return result(outcome=TransferOutcome.FAILED, elapsed_s=time.perf_counter() - started,
                                  error=ErrorCode.TIMEOUT, detail=f"{op} not complete in time")
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
                status = self._agent.getXferStatus(handle)
            if status != nixl.NIXL_SUCCESS:
                return result(outcome=TransferOutcome.FAILED, elapsed_s=time.perf_counter() - started,
                              error=ErrorCode.INTERNAL, detail=f"{op} ended with {status}")
            return result(outcome=TransferOutcome.DONE, elapsed_s=time.perf_counter() - started)
        except self._nixl_errors as error:
            return result(outcome=TransferOutcome.FAILED, elapsed_s=time.perf_counter() - started,
                          error=_error_code(nixl, error), detail=f"{op}: {type(error).__name__}: {error}")
        finally:
            if handle is not None:
                self._release(handle)

    def _release(self, handle: int) -> None:
        # Releasing an unfinished transfer asks NIXL to cancel it; if it cannot, the handle
        # is kept and retried at close().
        try:
            status = self._agent.releaseXferReq(handle)
        except self._nixl_errors:
            status = None
        if status != self._nixl.NIXL_SUCCESS:
            with self._lock:
                self._unreleased.append(handle)

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
            unreleased, self._unreleased = self._unreleased, []
        for handle in unreleased:
            try:
                self._agent.releaseXferReq(handle)
            except self._nixl_errors:
                pass
        if self._registration is not None:
            self._agent.deregisterMem(self._registration, [])
            self._registration = None
        self._agent = None  # the bindings' destructor joins NIXL's threads
        self._buffer = None

    def __enter__(self) -> KvAgent:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
