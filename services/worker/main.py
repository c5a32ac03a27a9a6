"""Wiring for the worker: config -> engine -> service, until SIGTERM/SIGINT or a Drain."""

from __future__ import annotations

import asyncio
import logging

from services.worker.engine import Engine
from services.worker.engine_spec import EngineSpec
from services.worker.engines import engine_spec
from services.worker.service import WorkerService
from shared.bus import Bus, connect
from shared.config import ConfigError, WorkerConfig
from shared.lifecycle import stop_on_signals
from shared.tracing import setup_tracing

log = logging.getLogger(__name__)


def build_kv(config: WorkerConfig, spec: EngineSpec, engine: Engine, bus: Bus):
    if not config.kv_transfer.enabled:
        return None
    if config.kv_transfer.transport == "nixl":
        from connector.nixl_agent import nixl_available

        if not nixl_available():
            raise ConfigError("the NIXL KV transport needs NIXL (pip install --no-deps nixl-cu12); "
                              "use the in-memory transport between workers of one process, or run "
                              "with --no-kv-transfer to compute everything locally")
    return spec.build_data_plane(config, engine, bus)


async def run_worker(config: WorkerConfig, *, ready: asyncio.Event | None = None) -> None:
    config.validate()
    setup_tracing(f"tandem-worker-{config.worker_id}", config.tracing.exporter, config.tracing.otlp_endpoint)
    spec = engine_spec(config.engine)
    engine = spec.build_engine(config)
    bus = await connect(config.bus, f"worker-{config.worker_id}")
    await engine.start()
    service = WorkerService(config, engine, bus, build_kv(config, spec, engine, bus), capabilities=spec.capabilities)
    await service.start()
    if ready is not None:
        ready.set()
    try:
        # The handlers stay installed through the stop: a second SIGTERM (the launcher's
        # parent-death signal after a first one) must not kill the process half-way.
        with stop_on_signals() as stop_requested:
            stopped = asyncio.create_task(service.stopped.wait())
            requested = asyncio.create_task(stop_requested.wait())
            await asyncio.wait({stopped, requested}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            requested.cancel()
            if not service.stopped.is_set():
                log.info("worker %s stopping: draining %d in-flight request(s)", config.worker_id, service.inflight)
                await service.stop()
    finally:
        await bus.close()
