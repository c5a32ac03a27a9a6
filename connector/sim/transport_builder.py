"""Builds the transports a worker's KV ranks are reached through: one per rank, of the kind
`KvTransferConfig.transport` names (NIXL, or in-memory between workers of one process).
Called by the sim engine's data plane builder (`services/worker/sim/spec.py`) and by tests
that assemble workers. Fault injection is the reader's and the writer's
(`connector.faults`), not the transports'.
"""

from __future__ import annotations

import uuid

from connector.kv_peer import rank_agent_name
from connector.memory_transport import MemoryFabric, MemoryTransport
from connector.port import KvPort
from connector.rank_transports import RankTransports
from connector.transport import KvTransport
from shared.config import WorkerConfig


def build_rank_transports(config: WorkerConfig, port: KvPort, *, fabric: MemoryFabric | None = None) -> RankTransports:
    """One transport per rank of the engine's KV (`port.kv_shape()`), over its region.
    `fabric`: the memory transport's (default: the process's own)."""
    shape, regions = port.kv_shape(), port.kv_regions()
    settings = config.kv_transfer
    # A fresh agent name per incarnation: readers see the change and re-add the peer.
    name = f"{config.worker_id}-{uuid.uuid4().hex[:8]}"
    transports: list[KvTransport] = []
    try:
        for rank, region in zip(shape.ranks, regions):
            agent = rank_agent_name(name, rank.rank)
            if settings.transport == "memory":
                transports.append(MemoryTransport(agent, region, rank.block_stride, rank.layer_stride, fabric=fabric))
            else:
                from connector.nixl_transport import NixlTransport

                transports.append(NixlTransport(agent, region, rank.block_stride, rank.layer_stride,
                                                progress_delay_us=settings.progress_delay_us,
                                                transfer_timeout_s=settings.transfer_timeout_s))
    except BaseException:
        for transport in transports:
            transport.close()
        raise
    return RankTransports(name, shape, regions, transports)
