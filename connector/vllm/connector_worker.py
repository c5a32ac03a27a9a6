"""The worker side of Tandem's vLLM connector: runs in each of vLLM's model-worker processes
(one per tensor-parallel rank), on its main thread, between and around forward passes.

Each rank owns its NIXL agent (`connector.nixl_agent.KvAgent`, progress thread with a
non-zero delay: it must not spin), registered once over the rank's whole KV allocation, and
knows where its blocks, layers and KV heads live (`connector.kv_geometry.layer_major`: vLLM's
CPU layout; its heads are the rank's TP slice). What it tells the Tandem worker
(`tandem_agent_metadata`: a `RankAgent`) becomes, with the other ranks', the worker's
`connector.kv_peer.KvPeer`. Pulls are `rank_loads.RankLoads` (each rank reads its heads from
the holder ranks that hold them), pushes `connector_push.PushWrites` (each rank writes its
heads into the reader's ranks), both over this rank's agent and region; checksums are the
data plane's per-head unit sums over this rank's heads (`checksums`), which the Tandem
worker combines. Every `Loaded` and `Pushed` the rank sends carries its agent's transfer
counters at that moment (`CountedReports`): the Tandem worker keeps them for its load
snapshot and never asks the ranks for them between steps.

A host-memory tier (`host_blocks` > 0) is a second array of pages in this process,
layer-major like vLLM's: `HostCopy` loads copy slots into the loading request's blocks in
`start_load_kv` (which vLLM calls after the step's forward pass, for asynchronous loads; the
request waits outside it and is reported loaded in the same step), then saves copy the
step's computed blocks into slots in `wait_for_save`: a slot a save takes is read by every
load planned before it first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from connector.agent_types import KvAgentConfig
from connector.agent_types import TransferResult as AgentResult
from connector.kv_checksums import Piece, unit_sums
from connector.kv_geometry import KvShape, RankGeometry, RankSlice, Tiling, layer_major, rank_slices
from connector.kv_peer import KvPeer, decode_peer
from connector.nixl_agent import KvAgent
from connector.transport import TransferResult
from connector.vllm.connector_push import PushWrites
from connector.vllm.kv_pages import PageGeometry, page_ids
from connector.vllm.kv_reports import ReportSink
from connector.vllm.kv_wire import (
    HostCopy,
    Loaded,
    LoadSpec,
    Pushed,
    PushSpec,
    RankAgent,
    RankChecksums,
    Report,
    TailCopy,
)
from connector.vllm.rank_loads import RankLoads
from shared.codec import encode
from shared.config import KvFaultConfig, KvRetryConfig
from shared.schemas.load import RankTransfers

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


class AgentRanges:
    """The rank's NIXL agent as a range mover (`connector.shaped_read.RangeMover`), for one
    pull on the loader thread: the agent copies inside the posting call (the pull's event
    loop runs nothing else meanwhile)."""

    def __init__(self, agent: KvAgent) -> None:
        self._agent = agent

    async def read_ranges(self, peer: str, remote_offsets: np.ndarray, local_offsets: np.ndarray,
                          lengths: np.ndarray, *, timeout_s: float) -> TransferResult:
        return _result(self._agent.read_ranges(peer, remote_offsets, local_offsets, lengths, timeout_s=timeout_s))

    async def write_ranges(self, peer: str, remote_offsets: np.ndarray, local_offsets: np.ndarray,
                           lengths: np.ndarray, *, timeout_s: float) -> TransferResult:
        return _result(self._agent.write_ranges(peer, remote_offsets, local_offsets, lengths, timeout_s=timeout_s))


def _result(result: AgentResult) -> TransferResult:
    return TransferResult(outcome="done" if result.ok else "failed", ok=[result.ok],
                          nbytes=result.nbytes if result.ok else 0, duration_s=result.elapsed_s,
                          reason="" if result.ok else result.detail)


class CountedReports:
    """The rank's reports as its pulls and pushes send them: each `Loaded` and `Pushed` leaves
    with the rank's transfer counters read at that moment (on the engine thread, after the
    transfer it reports), so the Tandem worker's latest lack only transfers not yet reported.
    Asking the ranks for them instead (a utility RPC between steps) was seen to leave a
    multi-process engine's core waiting for a rank's answer forever."""

    def __init__(self, reports: ReportSink, counters: Callable[[], RankTransfers]) -> None:
        self._reports = reports
        self._counters = counters

    def send(self, report: Report) -> None:
        if isinstance(report, Loaded | Pushed):
            report = msgspec.structs.replace(report, transfers=self._counters())
        self._reports.send(report)


class WorkerSide:
    def __init__(self, *, agent_name: str, part: RankSlice, num_layers: int, num_kv_heads: int, tensor_parallel: int,
                 block_size: int, agent_config: KvAgentConfig, faults: KvFaultConfig, reports: ReportSink,
                 retry: KvRetryConfig = KvRetryConfig(), host_blocks: int = 0, tiling: Tiling = Tiling()) -> None:
        self._agent_name = agent_name
        self._tiling = tiling
        self._part = part
        self._model = (num_layers, num_kv_heads, tensor_parallel)
        self._block_size = block_size
        self._host_blocks = host_blocks
        self._host: np.ndarray | None = None  # (host_blocks * num_layers, page_nbytes): the host tier's pages
        self._host_saves: list[HostCopy] = []  # this step's, copied in `host_save`
        self._copied_loads: set[str] = set()  # requests whose KV was copied in place this step (host tier, push tails)
        self._agent_config = agent_config
        self._agent: KvAgent | None = None
        self._geometry: PageGeometry | None = None
        self.rank: RankGeometry | None = None
        self.shape: KvShape | None = None  # every rank's of this engine (a push writer's)
        self._region: np.ndarray | None = None  # flat uint8 view of vLLM's allocation
        self._pages: np.ndarray | None = None  # (num_pages, page_nbytes) view of it
        self._backing: torch.Tensor | None = None  # keeps the views' memory referenced
        self._peers: dict[str, KvPeer] = {}  # peer agent name -> its description, its rank agents added
        reports = CountedReports(reports, self.transfer_stats)
        self.pulls = RankLoads(faults=faults, retry=retry, timeout_s=agent_config.default_timeout_s,
                               reports=reports, peer_of=self.peer_of)
        self.pushes = PushWrites(lambda: self.agent, self._require_rank, self._require_shape, self.peer_of,
                                 self._block_checksums, faults, reports, agent_config.default_timeout_s)

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
        rank = self._rank_geometry(geometry)
        backing = torch.empty(0, dtype=torch.uint8)
        backing.set_(storage, 0, (geometry.nbytes,), (1,))
        buffer = backing.numpy()
        agent = KvAgent(self._agent_name, self._agent_config)
        try:
            agent.register_pool(buffer, geometry.page_nbytes)
        except BaseException:
            agent.close()
            raise
        self._agent, self._geometry, self._backing, self.rank, self._region = agent, geometry, backing, rank, buffer
        self._pages = buffer.reshape(geometry.num_pages, geometry.page_nbytes)
        self.pulls.bind(rank, buffer, AgentRanges(agent))
        if self._host_blocks:
            self._host = np.zeros((self._host_blocks * geometry.num_layers, geometry.page_nbytes), dtype=np.uint8)
        # Each layer's tensor is a view at its layer's offset in the one allocation.
        base = storage.data_ptr()
        layer_nbytes = geometry.num_blocks * geometry.page_nbytes
        self.pushes.bind_layers({name: (tensor.data_ptr() - base) // layer_nbytes
                                 for name, tensor in kv_caches.items()})
        log.info("Tandem KV agent %s (rank %d: heads %d-%d): %d layers x %d blocks of %d-byte pages registered",
                 self._agent_name, rank.rank, rank.first_head, rank.heads.stop - 1, geometry.num_layers,
                 geometry.num_blocks, geometry.page_nbytes)

    def _rank_geometry(self, pages: PageGeometry) -> RankGeometry:
        """This rank's blocks, layers and heads in vLLM's pages; refuses a page size that is
        not the rank's heads' K and V vectors of a block."""
        num_layers, num_kv_heads, tensor_parallel = self._model
        part, size = self._part, self._block_size
        token_nbytes, rest = divmod(pages.page_nbytes, part.num_heads * 2 * size)
        if rest or pages.num_layers != num_layers:
            raise ValueError(f"vLLM's pages ({pages}) are not {num_layers} layers of {part.num_heads} KV heads x "
                             f"{size} tokens")
        self.shape = KvShape(block_size=size, num_layers=num_layers, num_kv_heads=num_kv_heads, ranks=[
            layer_major(other, num_blocks=pages.num_blocks, block_size=size, token_nbytes=token_nbytes,
                        tiling=self._tiling) for other in rank_slices(num_layers, num_kv_heads, tensor_parallel)])
        return self.shape.ranks[part.rank]

    def _require_rank(self) -> RankGeometry:
        assert self.rank is not None, "register_kv_caches() first"
        return self.rank

    def _require_shape(self) -> KvShape:
        assert self.shape is not None, "register_kv_caches() first"
        return self.shape

    def metadata(self) -> bytes:
        """This rank as the Tandem worker describes it to peers (`RankAgent`, msgpack)."""
        return encode(RankAgent(geometry=self._require_rank(), agent_name=self._agent_name,
                                metadata=self.agent.metadata()))

    def transfer_stats(self) -> RankTransfers:
        """This rank's agent's transfer counters so far, as the load snapshot carries them."""
        return self.agent.stats.of_rank(self._require_rank().rank)

    def peer_of(self, name: str, metadata: bytes) -> KvPeer:
        """A peer worker (a holder or a push's reader), its rank agents reachable from this
        rank. Names are unique per incarnation: a known name is not added again."""
        peer = self._peers.get(name)
        if peer is None:
            peer = decode_peer(metadata)
            if peer.agent_name != name:
                raise ValueError(f"metadata is for agent {peer.agent_name!r}, not {name!r}")
            for agent, rank_metadata in zip(peer.rank_agents, peer.rank_metadata):
                self.agent.add_peer(agent, rank_metadata)
            self._peers[name] = peer
        return peer

    # ---- checksums -------------------------------------------------------------------------

    def checksums(self, units: list[list[Piece]]) -> bytes:
        """This rank's share of the units' checksums (`RankChecksums`, msgpack)."""
        rank, region = self._require_rank(), self._region
        assert region is not None
        sums = unit_sums(region, rank, units)
        return encode(RankChecksums(heads=list(rank.heads), values=sums.reshape(-1).tolist()))

    def _block_checksums(self, block_ids: list[int]) -> list[int]:
        """This rank's checksums of whole blocks, flat (block by block, its heads)."""
        rank, region = self._require_rank(), self._region
        assert region is not None
        return unit_sums(region, rank, [[(block_id, 0, rank.block_size)] for block_id in block_ids]).reshape(-1).tolist()

    # ---- pulls and pushes (see rank_loads, connector_push) ----------------------------------

    def load(self, specs: list[LoadSpec]) -> None:
        self.pulls.load(specs)

    def take_loaded(self, wait_s: float = 0.0) -> set[str]:
        copied, self._copied_loads = self._copied_loads, set()
        return self.pulls.take_loaded(0.0 if copied else wait_s) | copied

    def take_load_errors(self) -> set[int]:
        return self.pulls.take_load_errors()

    def begin_pushes(self, specs: list[PushSpec]) -> None:
        if specs:
            self.pushes.begin(specs)

    def layer_computed(self, layer_name: str) -> None:
        self.pushes.layer_computed(layer_name)

    def end_pushes(self) -> None:
        self.pushes.end()

    # ---- a push's partial last block (see push_tail) ---------------------------------------

    def tail_copy(self, copies: list[TailCopy]) -> None:
        """A push's partial last block into the request's own block, every layer, whole; each
        request is reported loaded this step (`connector.vllm.push_tail`)."""
        pages, geometry = self._pages, self._geometry
        assert pages is not None and geometry is not None, "a copy before the KV cache was registered"
        for copy in copies:
            pages[page_ids([copy.target], geometry.num_layers, geometry.num_blocks)] = \
                pages[page_ids([copy.source], geometry.num_layers, geometry.num_blocks)]
            self._copied_loads.add(copy.request_id)

    # ---- the host tier (see host_scheduler) ------------------------------------------------

    def host_load(self, loads: list[HostCopy]) -> None:
        """Copy host slots into vLLM's blocks; each request is reported loaded this step."""
        for load in loads:
            self._host_copy(load, into_host=False)
            self._copied_loads.add(load.request_id)

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

    def close(self) -> None:
        self.pulls.close()
        self.pushes.close()
        if self._agent is not None:
            self._agent.close()
            self._agent = None
