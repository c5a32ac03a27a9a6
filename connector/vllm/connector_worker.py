"""The worker side of Tandem's vLLM connector: runs in vLLM's model-worker process, on its
main thread, between and around forward passes.

It owns the engine's NIXL agent (`connector.nixl_agent.KvAgent`, progress thread with a
non-zero delay: it must not spin), registered once over vLLM's whole KV allocation as
layer-major pages (`kv_pages`). A pull (`LoadSpec`) starts in `start_load_kv` of the step
that planned it and is read on the connector's loader thread (one pull at a time; NIXL
copies inside the posting call on one host, bounded by the transfer timeout), so the
requests decoding here go on meanwhile; the pulling request waits in vLLM until
`get_finished` names it, in the first step after its pull ended. Fault injection
(`connector.faults`), the verification of each block against the holder's checksum
(`connector.block_reader`) and the retry of blocks that failed (`connector.retry`, once,
bounded in time, on the same thread) are the sim reader's; blocks that still failed go to
vLLM through `get_block_ids_with_load_errors` in the step whose `get_finished` names the
request (vLLM rolls it back to its first failed block), and every pull ends in exactly
one `Loaded` report to the Tandem worker, sent from the engine thread. Pushes (the writer's
per-layer writes, from vLLM's save hook) are `connector_push.PushWrites`, over the same
agent and pages.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from connector.agent_types import KvAgentConfig
from connector.block_reader import verified_blocks
from connector.faults import ReadFaults
from connector.nixl_agent import KvAgent
from connector.retry import retry_sync
from connector.vllm.connector_push import PushWrites
from connector.vllm.kv_pages import PageGeometry, block_checksum, page_ids, scribble
from connector.vllm.kv_reports import ReportSender
from connector.vllm.kv_wire import Loaded, LoadSpec, PushSpec
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


class WorkerSide:
    def __init__(self, *, agent_name: str, agent_config: KvAgentConfig, faults: KvFaultConfig,
                 reports: ReportSender, retry: KvRetryConfig = KvRetryConfig()) -> None:
        self._agent_name = agent_name
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

    def checksums(self, block_ids: list[int]) -> list[int]:
        return [self._checksum(block_id) for block_id in block_ids]

    def _checksum(self, block_id: int) -> int:
        assert self._pages is not None and self._geometry is not None
        return block_checksum(self._pages, self._geometry, block_id)

    def close(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)
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
        return {request_id for request_id, _, _ in done}

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
        timeout_s = self._agent_config.default_timeout_s
        ok, nbytes, reason = self._read(spec, list(range(count)), timeout_s)
        moved = [nbytes]

        def read_again(indices: list[int], timeout_s: float) -> list[bool]:
            again, nbytes, _ = self._read(spec, indices, timeout_s)
            moved[0] += nbytes
            return again

        retry = retry_sync(self._retry, ok, read_again, cap_s=timeout_s)
        if retry.recovered:
            log.info("pull %s: %d of %d failed block(s) recovered on retry", spec.transfer_id, retry.recovered,
                     retry.retried)
            reason = reason if False in ok else ""
        failed = [block_id for block_id, good in zip(spec.local_block_ids, ok) if not good]
        if failed:
            log.warning("pull %s: %d of %d block(s) failed (%s); vLLM recomputes from the first",
                        spec.transfer_id, len(failed), count, reason)
        return Loaded(ok=ok, nbytes=moved[0], duration_s=time.perf_counter() - started, reason=reason,
                      retried=retry.retried, recovered=retry.recovered, **report), failed

    def _read(self, spec: LoadSpec, indices: list[int], timeout_s: float) -> tuple[list[bool], int, str]:
        """Read the blocks at `indices` of the spec: per block, whether its bytes landed and
        verified; bytes moved; why not."""
        remote = [spec.remote_block_ids[index] for index in indices]
        local = [spec.local_block_ids[index] for index in indices]
        landed, nbytes, reason = self._read_blocks(spec, remote, local, timeout_s)
        ok = verified_blocks(landed, local, [spec.checksums[index] for index in indices], self._checksum)
        if ok != landed:
            reason = reason or "checksum mismatch"
        return ok, nbytes, reason

    def _read_blocks(self, spec: LoadSpec, remote_block_ids: list[int], local_block_ids: list[int],
                     timeout_s: float) -> tuple[list[bool], int, str]:
        """Per block: whether its bytes landed; bytes moved; why not."""
        count = len(local_block_ids)
        faults = self._faults.config
        if faults.delay_s:
            time.sleep(faults.delay_s)
        if faults.fail_transfer:
            return [False] * count, 0, "injected: transfer failed"
        try:
            self._ensure_peer(spec.agent_name, spec.agent_metadata)
        except Exception as error:  # malformed or incompatible metadata: nothing can be read
            return [False] * count, 0, f"holder agent unusable: {error}"
        geometry = self._geometry
        peer_pool = self.agent.peer_pool(spec.agent_name)
        assert geometry is not None and peer_pool is not None
        remote_blocks = peer_pool.num_blocks // geometry.num_layers
        cut = self._faults.blocks_before_cut(spec.agent_name, remote_block_ids)
        result = self.agent.read_blocks(
            spec.agent_name, page_ids(remote_block_ids[:cut], geometry.num_layers, remote_blocks),
            page_ids(local_block_ids[:cut], geometry.num_layers, geometry.num_blocks), timeout_s=timeout_s)
        ok = [result.ok] * cut + [False] * (count - cut)
        reason = result.detail if not result.ok else ("injected: transfer cut" if cut < count else "")
        if self._faults.inject(spec.agent_name, remote_block_ids, local_block_ids, ok, self._scribble):
            reason = reason or "injected: blocks failed"
        return ok, result.nbytes if result.ok else 0, reason

    def _scribble(self, block_id: int) -> None:
        assert self._pages is not None and self._geometry is not None
        scribble(self._pages, self._geometry, block_id)

    def _ensure_peer(self, name: str, metadata: bytes) -> None:
        # Agent names are unique per incarnation: an unknown name is a new peer; a known name
        # with new metadata is re-added (KvAgent forgets the old connection first).
        if self._peers.get(name) != metadata:
            self.agent.add_peer(name, metadata)
            self._peers[name] = metadata
