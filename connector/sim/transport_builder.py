"""Builds the transport a worker's KV pool is reached through: the one
`KvTransferConfig.transport` names (NIXL, or in-memory between workers of one process),
wrapped in fault injection when faults are configured. Called by the sim engine's data
plane builder (`services/worker/sim/spec.py`) and by tests that assemble workers.
"""

from __future__ import annotations

import logging
import uuid

from connector.faults import FaultInjectingTransport
from connector.memory_transport import MemoryFabric, MemoryTransport
from connector.port import KvPort
from connector.transport import KvTransport
from shared.config import WorkerConfig

log = logging.getLogger(__name__)


def build_transport(config: WorkerConfig, port: KvPort, *, fabric: MemoryFabric | None = None) -> KvTransport:
    """The transport `config.kv_transfer.transport` names, over the engine's KV region,
    wrapped in fault injection when faults are configured. `fabric`: the memory transport's
    (default: the process's own)."""
    region = port.kv_region()
    settings = config.kv_transfer
    # A fresh agent name per incarnation: readers see the change and re-add the peer.
    name = f"{config.worker_id}-{uuid.uuid4().hex[:8]}"
    transport: KvTransport
    if settings.transport == "memory":
        transport = MemoryTransport(name, region.buffer, region.block_nbytes, region.layer_nbytes, fabric=fabric)
    else:
        from connector.nixl_transport import NixlTransport

        transport = NixlTransport(name, region.buffer, region.block_nbytes, region.layer_nbytes,
                                  progress_delay_us=settings.progress_delay_us,
                                  transfer_timeout_s=settings.transfer_timeout_s)
    if settings.faults.active:
        log.warning("%s: KV fault injection is on: %s", config.worker_id, settings.faults)
        transport = FaultInjectingTransport(transport, settings.faults, region.buffer, region.block_nbytes)
    return transport
