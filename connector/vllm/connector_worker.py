"""The worker side of Tandem's vLLM connector: runs in vLLM's model-worker process, on its
main thread, between and around forward passes.

It owns the engine's NIXL agent (`connector.nixl_agent.KvAgent`, progress thread with a
non-zero delay: it must not spin), registered once over vLLM's whole KV allocation as
layer-major pages (`kv_pages`). A pull (`LoadSpec`) starts in `start_load_kv` of the step
that planned it and is read on the connector's loader thread (one pull at a time; NIXL
copies inside the posting call on one host, bounded by the transfer timeout), so the
requests decoding here go on meanwhile; the pulling request waits in vLLM until
`get_finished` names it, in the first step after its pull ended. The read is the sim
reader's (`connector.block_io.read_verified`: read, verify each block against the holder's
checksum, read the failed ones again, bounded in time), over this side's block-I/O port
(`PageReads`), wrapped in the same fault injection (`connector.faults.FaultInjectingReader`);
it runs on the loader thread, in that thread's own event loop. Blocks that still failed go to
vLLM through `get_block_ids_with_load_errors` in the step whose `get_finished` names the
request (vLLM rolls it back to its first failed block), and every pull ends in exactly
one `Loaded` report to the Tandem worker, sent from the engine thread. Pushes (the writer's
per-layer writes, from vLLM's save hook) are `connector_push.PushWrites`, over the same
agent and pages. A host-memory tier (`host_blocks` > 0) is a second array of pages in this
process, layer-major like vLLM's: `HostCopy` loads copy slots into the loading request's
blocks in `start_load_kv` (which vLLM calls after the step's forward pass, for asynchronous
loads; the request waits outside it and is reported loaded in the same step), then saves copy
the step's computed blocks into slots in `wait_for_save`: a slot a save takes is read by every
load planned before it first.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from connector.agent_types import KvAgentConfig
from connector.block_io import read_verified
from connector.faults import FaultInjectingReader, ReadFaults
from connector.nixl_agent import KvAgent
from connector.transport import TransferResult
from connector.vllm.connector_push import PushWrites
from connector.vllm.kv_pages import PageGeometry, block_checksum, page_ids, scribble
from connector.vllm.kv_reports import ReportSender
from connector.vllm.kv_wire import HostCopy, Loaded, LoadSpec, PushSpec
from shared.config import KvFaultConfig, KvRetryConfig

if TYPE_CHECKING:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)


def page_geometry(kv_cache_config: KVCacheConfig) -> PageGeometry:
    """vLLM's allocation as pages; refuses layouts Tandem cannot address by block id."""
    tensors = kv_cache_config.kv_cache_tensors
    groups = kv_cache_config.kv_cache_groups
    if len(tensors) != 1 or len(groups) != 1:
        raise ValueError(f"Tandem's connector needs one KV cache tensor and one group, got "
                         f"{len(tensors)} and {len(groups)}")
    (tensor,) = tensors
    geometry = PageGeometry(num_layers=len(tensor.layers), num_blocks=kv_cache_config.num_blocks,
                            page_nbytes=tensor.block_stride)
    geometry.validate()
    if tensor.offset != 0 or tensor.layer_stride != geometry.num_blocks * geometry.page_nbytes \
            or tensor.size < geometry.nbytes:
        raise ValueError(f"Tandem's connector needs a layer-major KV cache (layer stride = blocks x block "
                         f"stride), got {tensor}")
    return geometry


class PageReads:
    """vLLM's block-I/O port (`connector.block_io.BlockReader`) for one pull: NIXL reads into
    vLLM's KV pages, from the holder whose agent metadata the pull carries."""

    def __init__(self, side: WorkerSide, agent_metadata: bytes) -> None:
        self._side = side
        self._agent_metadata = agent_metadata

    async def read(self, peer: str, remote_block_ids: list[int], local_block_ids: list[int], *,
                   timeout_s: float) -> TransferResult:
        # Blocking, on the loader thread: the pull's event loop runs nothing else.
        return self._side.read_pages(peer, self._agent_metadata, remote_block_ids, local_block_ids, timeout_s)


class WorkerSide:
    def __init__(self, *, agent_name: str, agent_config: KvAgentConfig, faults: KvFaultConfig,
                 reports: ReportSender, retry: KvRetryConfig = KvRetryConfig(), host_blocks: int = 0) -> None:
        self._agent_name = agent_name
        self._host_blocks = host_blocks
        self._host: np.ndarray | None = None  # (host_blocks * num_layers, page_nbytes): the host tier's pages
        self._host_saves: list[HostCopy] = []  # this step's, copied in `host_save`
        self._host_loaded: set[str] = set()  # requests whose host load was copied this step
        self._agent_config = agent_config
        self._faults = ReadFaults(faults)
        self._retry = retry
        self._reports = reports
        self._agent: KvAgent | None = None
        self._geometry: PageGeometry | None = None
        self._pages: np.ndarray | None = None  # (num_pages, page_nbytes) uint8 view of vLLM's allocation
        self._backing: torch.Tensor | None = None  # keeps the view's memory referenced
        self._peers: dict[str, bytes] = {}  # agent name -> metadata added
        self._load_errors: set[int] = set()
        # Pulls run one at a time on a thread of their own, beside the forward passes: the
        # streams decoding here go on while a new request's KV arrives.
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-kv-load")
        self._loader_loop = asyncio.new_event_loop()  # runs each pull's read, on the loader thread only
        self._done_lock = threading.Lock()
        self._done: list[tuple[str, Loaded, list[int]]] = []  # ended pulls: request id, report, failed blocks
        self.loads = 0  # pulls performed, for diagnostics
        self.pushes = PushWrites(lambda: self.agent, self._require_geometry, self._ensure_peer, self._checksum,
                                 faults, reports, agent_config.default_timeout_s)

    @property
    def agent(self) -> KvAgent:
        assert self._agent is not None, "register_kv_caches() first"
        return self._agent

    def register(self, kv_caches: dict[str, torch.Tensor], geometry: PageGeometry) -> None:
        import torch

        storages = {tensor.untyped_storage().data_ptr() for tensor in kv_caches.values()}
        if len(storages) != 1:
            raise ValueError(f"Tandem's connector needs one KV allocation, vLLM made {len(storages)}")
        storage = next(iter(kv_caches.values())).untyped_storage()
        if storage.nbytes() < geometry.nbytes:
            raise ValueError(f"the KV allocation has {storage.nbytes()} bytes, the layout needs {geometry.nbytes}")
        backing = torch.empty(0, dtype=torch.uint8)
        backing.set_(storage, 0, (geometry.nbytes,), (1,))
        buffer = backing.numpy()
        agent = KvAgent(self._agent_name, self._agent_config)
        try:
            agent.register_pool(buffer, geometry.page_nbytes)
        except BaseException:
            agent.close()
            raise
        self._agent, self._geometry, self._backing = agent, geometry, backing
        self._pages = buffer.reshape(geometry.num_pages, geometry.page_nbytes)
        if self._host_blocks:
            self._host = np.zeros((self._host_blocks * geometry.num_layers, geometry.page_nbytes), dtype=np.uint8)
        # Each layer's tensor is a view at its layer's offset in the one allocation.
        base = storage.data_ptr()
        layer_nbytes = geometry.num_blocks * geometry.page_nbytes
        self.pushes.bind_layers({name: (tensor.data_ptr() - base) // layer_nbytes
                                 for name, tensor in kv_caches.items()})
        log.info("Tandem KV agent %s: %d layers x %d blocks of %d-byte pages registered",
                 self._agent_name, geometry.num_layers, geometry.num_blocks, geometry.page_nbytes)

    def _require_geometry(self) -> PageGeometry:
        assert self._geometry is not None, "register_kv_caches() first"
        return self._geometry

    def metadata(self) -> bytes:
        return self.agent.metadata()

    # ---- pushes (see connector_push) ----------------------------------------------------

    def begin_pushes(self, specs: list[PushSpec]) -> None:
        if specs:
            self.pushes.begin(specs)

    def layer_computed(self, layer_name: str) -> None:
        self.pushes.layer_computed(layer_name)

    def end_pushes(self) -> None:
        self.pushes.end()

    # ---- the host tier (see host_scheduler) ------------------------------------------------

    def host_load(self, loads: list[HostCopy]) -> None:
        """Copy host slots into vLLM's blocks; each request is reported loaded this step."""
        for load in loads:
            self._host_copy(load, into_host=False)
            self._host_loaded.add(load.request_id)

    def stage_host_saves(self, saves: list[HostCopy]) -> None:
        self._host_saves = saves

    def host_save(self) -> None:
        """End of the forward pass: copy this step's computed blocks into their slots."""
        saves, self._host_saves = self._host_saves, []
        for save in saves:
            self._host_copy(save, into_host=True)

    def _host_copy(self, copy: HostCopy, *, into_host: bool) -> None:
        pages, host, geometry = self._pages, self._host, self._geometry
        assert pages is not None and host is not None and geometry is not None, "a host tier copy without one"
        block_pages = page_ids(copy.block_ids, geometry.num_layers, geometry.num_blocks)
        slot_pages = page_ids(copy.slots, geometry.num_layers, self._host_blocks)
        if into_host:
            host[slot_pages] = pages[block_pages]
        else:
            pages[block_pages] = host[slot_pages]

    def checksums(self, block_ids: list[int]) -> list[int]:
        return [self._checksum(block_id) for block_id in block_ids]

    def _checksum(self, block_id: int) -> int:
        assert self._pages is not None and self._geometry is not None
        return block_checksum(self._pages, self._geometry, block_id)

    def close(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)
        self._loader_loop.close()
        self.pushes.close()
        if self._agent is not None:
            self._agent.close()
            self._agent = None

    # ---- loads --------------------------------------------------------------------------

    def load(self, specs: list[LoadSpec]) -> None:
        for spec in specs:
            if not spec.local_block_ids:  # nothing to read: vLLM is not waiting for it
                self._reports.send(self._load(spec)[0])
            else:
                self._loader.submit(self._load_in_background, spec)

    def _load_in_background(self, spec: LoadSpec) -> None:
        try:
            report, failed = self._load(spec)
        except Exception as error:  # a bug: the request still hears, every block failed
            log.exception("pull %s failed", spec.transfer_id)
            report = Loaded(ok=[False] * len(spec.local_block_ids), reason=f"internal error: {error}",
                            transfer_id=spec.transfer_id, lease_id=spec.lease_id, cached_blocks=spec.cached_blocks)
            failed = list(spec.local_block_ids)
        with self._done_lock:
            self._done.append((spec.request_id, report, failed))

    def take_loaded(self) -> set[str]:
        """The requests whose loads ended since the last step (vLLM's `get_finished`); their
        failed blocks become this step's load errors, and their reports leave from here (the
        engine thread owns the report socket)."""
        with self._done_lock:
            done, self._done = self._done, []
        for _, report, failed in done:
            self._reports.send(report)
            self._load_errors.update(failed)
        host_loaded, self._host_loaded = self._host_loaded, set()
        return {request_id for request_id, _, _ in done} | host_loaded

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _load(self, spec: LoadSpec) -> tuple[Loaded, list[int]]:
        started = time.perf_counter()
        count = len(spec.local_block_ids)
        report = dict(transfer_id=spec.transfer_id, lease_id=spec.lease_id, cached_blocks=spec.cached_blocks)
        if count == 0:
            return Loaded(ok=[], reason="every block was cached locally", **report), []
        self.loads += 1
        reader = FaultInjectingReader(PageReads(self, spec.agent_metadata), self._faults, self._scribble)
        read = self._loader_loop.run_until_complete(read_verified(
            reader, self._checksum, spec.agent_name, spec.remote_block_ids, spec.local_block_ids, spec.checksums,
            retry=self._retry, timeout_s=self._agent_config.default_timeout_s))
        failed = [block_id for block_id, good in zip(spec.local_block_ids, read.ok) if not good]
        if failed:
            log.warning("pull %s: %d of %d block(s) failed (%s); vLLM recomputes from the first",
                        spec.transfer_id, len(failed), count, read.reason)
        return Loaded(ok=read.ok, nbytes=read.nbytes, duration_s=time.perf_counter() - started, reason=read.reason,
                      retried=read.retried, recovered=read.recovered, **report), failed

    def read_pages(self, peer: str, agent_metadata: bytes, remote_block_ids: list[int],
                   local_block_ids: list[int], timeout_s: float) -> TransferResult:
        """Read whole blocks (every layer's page) of a holder's pool into ours: one outcome for
        the whole read, as NIXL reports it."""
        count = len(local_block_ids)
        try:
            self._ensure_peer(peer, agent_metadata)
        except Exception as error:  # malformed or incompatible metadata: nothing can be read
            return TransferResult(outcome="failed", ok=[False] * count, reason=f"holder agent unusable: {error}")
        geometry = self._geometry
        peer_pool = self.agent.peer_pool(peer)
        assert geometry is not None and peer_pool is not None
        remote_blocks = peer_pool.num_blocks // geometry.num_layers
        result = self.agent.read_blocks(peer, page_ids(remote_block_ids, geometry.num_layers, remote_blocks),
                                        page_ids(local_block_ids, geometry.num_layers, geometry.num_blocks),
                                        timeout_s=timeout_s)
        return TransferResult(outcome="done" if result.ok else "failed", ok=[result.ok] * count,
                              nbytes=result.nbytes if result.ok else 0, reason="" if result.ok else result.detail)

    def _scribble(self, block_id: int) -> None:
        assert self._pages is not None and self._geometry is not None
        scribble(self._pages, self._geometry, block_id)

    def _ensure_peer(self, name: str, metadata: bytes) -> None:
        # Agent names are unique per incarnation: an unknown name is a new peer; a known name
        # with new metadata is re-added (KvAgent forgets the old connection first).
        if self._peers.get(name) != metadata:
            self.agent.add_peer(name, metadata)
            self._peers[name] = metadata
