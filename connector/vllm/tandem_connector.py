"""Tandem's own vLLM KV connector (`KVConnectorBase_V1`), loaded by vLLM through
`kv_connector_module_path="connector.vllm.tandem_connector"`, class `TandemConnector`.

Where each piece runs (one vLLM engine; at tensor-parallel degree N, N model workers, one
per rank, each with its share of the KV heads, its own NIXL agent and its own worker side):

    Tandem worker (AsyncLLM, NATS)     EngineCore (scheduler)          model worker (KV cache)
    ------------------------------     ----------------------          -----------------------
    leases (grant/release/expire),     SchedulerSide: external         WorkerSide: NIXL agent over
    NATS lease protocol, pulls'        tokens of a pull, load plans,   the KV pages, synchronous
    outcomes -> LeaseRelease           block references (pins)         READ + checksum per block
        |  kv_transfer_params in/out        |  LoadSpec in metadata ->     |
        |  control requests (pin/unpin) ->  |                              |
        |  collective_rpc (metadata, checksums) --------------------------> |
        <--- report socket (Pinned; Loaded, Pushed + rank's counters) -----+

Scheduler-side methods (EngineCore): `on_new_request`, `get_num_new_matched_tokens`
(asynchronous loads), `update_state_after_alloc`, `build_connector_meta`,
`update_connector_output`, `request_finished`.
Worker-side methods (model worker): `register_kv_caches`, `start_load_kv`, `get_finished`,
`get_block_ids_with_load_errors`; `save_kv_layer` (after each layer's attention) writes
that layer of a push's completed blocks, `wait_for_save` (end of the forward pass) ends a
push's step and, on its last, sends the outcome (holders keep blocks by reference).
The model worker also gains `TandemWorkerExtension`'s methods (vLLM's
`worker_extension_cls`), which the Tandem worker calls with `collective_rpc` when it needs an
answer (agent metadata, checksums); what it only counts rides on the reports (each rank's
transfer counters), never a periodic RPC between steps.

With a host-memory tier (`KvConnectorOptions.host_blocks`), the scheduler side also plans
copies between vLLM's blocks and host slots (`host_scheduler`) and announces them as KV
events (`take_events`); the worker side copies (loads in `start_load_kv`, saves in
`wait_for_save`).

Failures are data: a block that did not arrive or did not verify is reported to vLLM,
which recomputes from it (policy "recompute"), and to the Tandem worker in `Loaded`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_transfer import get_kv_transfer_group
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connector.agent_types import KvAgentConfig
from connector.kv_geometry import Tiling, rank_slices
from connector.kv_peer import rank_agent_name
from connector.vllm.connector_scheduler import SchedulerSide
from connector.vllm.connector_worker import WorkerSide, page_geometry
from connector.vllm.kv_pages import cpu_tiling
from connector.vllm.kv_reports import ReportSender
from connector.vllm.kv_wire import HostCopy, LoadSpec, PushSpec, TailCopy
from connector.vllm.rank_waits import quiet_rank_waits
from connector.vllm.settings import KvConnectorOptions

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

CONNECTOR_CLASS = "TandemConnector"
CONNECTOR_MODULE = __name__
WORKER_EXTENSION = f"{__name__}.TandemWorkerExtension"
# How long a step that computed nothing waits for a running pull to end before vLLM steps
# again: short against a pull, long against a step's own overhead
IDLE_STEP_WAIT_S = 0.005

quiet_rank_waits()  # imported in each rank before its queues open (rank_waits)


class ConnectorSettings(msgspec.Struct, frozen=True, kw_only=True):
    """`kv_connector_extra_config`, written by `VllmEngine`, read in vLLM's processes."""

    report_endpoint: str
    agent_name: str
    options: KvConnectorOptions = KvConnectorOptions()


class TandemMetadata(KVConnectorMetadata):
    def __init__(self, loads: list[LoadSpec], pushes: list[PushSpec] | None = None,
                 host_loads: list[HostCopy] | None = None, host_saves: list[HostCopy] | None = None,
                 idle: bool = False, tail_copies: list[TailCopy] | None = None) -> None:
        self.loads = loads
        self.idle = idle  # the step computes nothing (requests wait for their KV): see get_finished
        self.pushes = pushes or []
        self.host_loads = host_loads or []
        self.tail_copies = tail_copies or []  # pushes' partial last blocks (`push_tail`)
        self.host_saves = host_saves or []


class TandemConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        settings = msgspec.convert(self._kv_transfer_config.kv_connector_extra_config, ConnectorSettings)
        options = settings.options
        self._reports = reports = ReportSender(settings.report_endpoint)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role is KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(block_size=vllm_config.cache_config.block_size, reports=reports,
                                            host_blocks=options.host_blocks)
        else:
            model, tensor_parallel = vllm_config.model_config, vllm_config.parallel_config.tensor_parallel_size
            num_layers, num_kv_heads = model.get_total_num_hidden_layers(), model.get_total_num_kv_heads()
            rank = get_tensor_model_parallel_rank() if tensor_parallel > 1 else 0
            block_size = vllm_config.cache_config.block_size
            self._worker = WorkerSide(
                agent_name=rank_agent_name(settings.agent_name, rank), tiling=_tiling(vllm_config),
                part=rank_slices(num_layers, num_kv_heads, tensor_parallel)[rank], num_layers=num_layers,
                num_kv_heads=num_kv_heads, tensor_parallel=tensor_parallel,
                block_size=block_size,
                agent_config=KvAgentConfig(progress_delay_us=options.progress_delay_us,
                                           default_timeout_s=options.transfer_timeout_s),
                faults=options.faults, reports=reports, retry=options.retry, host_blocks=options.host_blocks)

    @property
    def scheduler_side(self) -> SchedulerSide:
        assert self._scheduler is not None, "scheduler-side method called on the worker side"
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        assert self._worker is not None, "worker-side method called on the scheduler side"
        return self._worker

    # ---- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register(kv_caches, page_geometry(self._kv_cache_config))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, TandemMetadata)
        if metadata.host_loads:
            self.worker_side.host_load(metadata.host_loads)
        if metadata.tail_copies:
            self.worker_side.tail_copy(metadata.tail_copies)
        if metadata.loads:
            self.worker_side.load(metadata.loads)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Before the forward pass (vLLM starts asynchronous loads only after it): the
        # step's pushes must be known when the first layer's save hook runs.
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, TandemMetadata):
            self.worker_side.begin_pushes(connector_metadata.pushes)
            self.worker_side.stage_host_saves(connector_metadata.host_saves)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a loading request is not in the forward pass: vLLM waits for get_finished()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # Called by vLLM's attention op after each layer (CPU too: `maybe_transfer_kv_layer`
        # wraps `unified_attention_with_output`); holders keep blocks by reference, pushes write.
        self.worker_side.layer_computed(layer_name)

    def wait_for_save(self) -> None:
        self.worker_side.end_pushes()
        self.worker_side.host_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # a step that computed nothing waits a little for a running pull (RankLoads.take_loaded)
        metadata = self._connector_metadata
        idle = isinstance(metadata, TandemMetadata) and metadata.idle
        return None, self.worker_side.take_loaded(IDLE_STEP_WAIT_S if idle else 0.0) or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        self._reports.close()

    # ---- scheduler side ------------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self.scheduler_side.bind_block_pool(gpu_block_pool)

    def on_new_request(self, request: Request) -> None:
        self.scheduler_side.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens = self.scheduler_side.matched_tokens(request, num_computed_tokens)
        return tokens, tokens > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler_side.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        side = self.scheduler_side
        host_loads, host_saves = side.take_host_copies(scheduler_output)
        return TandemMetadata(side.take_loads(), side.take_pushes(scheduler_output), host_loads, host_saves,
                              idle=scheduler_output.total_num_scheduled_tokens == 0, tail_copies=side.take_tail_copies())

    def take_events(self) -> list[KVCacheEvent]:
        return self.scheduler_side.take_events()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if connector_output.finished_recving:
            self.scheduler_side.on_output(connector_output.finished_recving)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Never a delayed free: held blocks carry their own reference (see SchedulerSide).
        return False, self.scheduler_side.request_finished(request, block_ids)


def _tiling(vllm_config: VllmConfig) -> Tiling:
    """How the attention kernel keeps a block's K and V (`kv_pages.cpu_tiling`); a device
    whose kernels Tandem has not measured moves whole blocks only."""
    block_size = vllm_config.cache_config.block_size
    if vllm_config.device_config.device_type != "cpu":
        return Tiling(k_tile_tokens=block_size, v_tile_tokens=block_size)
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    model = vllm_config.model_config
    isa = _get_attn_isa(model.dtype, block_size, model.get_head_size(), vllm_config.cache_config.cache_dtype)
    return cpu_tiling(isa, model.get_head_size(), block_size)


class TandemWorkerExtension:
    """Mixed into vLLM's model worker class (`worker_extension_cls`) for `collective_rpc`."""

    def tandem_agent_metadata(self) -> bytes:
        """This rank's `RankAgent` (msgpack)."""
        return _worker_side().metadata()

    def tandem_checksums(self, units: list[list[list[int]]]) -> bytes:
        """This rank's `RankChecksums` of units given as [[block, first token, tokens], ...]."""
        return _worker_side().checksums([[(block, token, count) for block, token, count in unit] for unit in units])


def _worker_side() -> WorkerSide:
    connector = get_kv_transfer_group()
    assert isinstance(connector, TandemConnector), f"the KV connector is {type(connector).__name__}"
    return connector.worker_side
