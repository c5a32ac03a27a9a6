"""Wiring for the worker: config -> engine -> service, until SIGTERM/SIGINT or a Drain."""

from __future__ import annotations

import asyncio
import logging

from services.worker.engine import Engine
from services.worker.service import WorkerService
from shared.bus import connect
from shared.config import ConfigError, WorkerConfig
from shared.lifecycle import stop_on_signals
from shared.tracing import setup_tracing

log = logging.getLogger(__name__)


def build_engine(config: WorkerConfig) -> Engine:
    if config.engine == "sim":
        from services.worker.sim.engine import SimEngine
        from shared.tokenizer import Tokenizer

        if not config.model_dir:
            raise ConfigError("the sim engine needs a model directory for its tokenizer (--model-dir)")
        tokenizer = Tokenizer.from_model_dir(config.model_dir)
        model_name = config.served_model_name or tokenizer.model_name
        return SimEngine(config, model_name=model_name, vocab_size=tokenizer.vocab_size)
    raise ConfigError(f"engine {config.engine!r} is not available in this build (supported: sim)")


async def run_worker(config: WorkerConfig, *, ready: asyncio.Event | None = None) -> None:
    config.validate()
    setup_tracing(f"tandem-worker-{config.worker_id}", config.tracing.exporter, config.tracing.otlp_endpoint)
    engine = build_engine(config)
    bus = await connect(config.bus.nats_url, f"worker-{config.worker_id}")
    await engine.start()
    service = WorkerService(config, engine, bus)
    await service.start()
    if ready is not None:
        ready.set()
    try:
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
