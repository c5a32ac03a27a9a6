"""Wiring for the worker: config -> engine -> service, until SIGTERM/SIGINT or a Drain."""

from __future__ import annotations

import asyncio
import logging

from connector.worker_kv import WorkerKv, build_transport
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
    if config.engine == "vllm":
        try:
            from services.worker.vllm.engine import VllmEngine
            from services.worker.vllm.options import VllmEngineOptions
        except ImportError as error:
            raise ConfigError(f"vLLM is not installed (make install-vllm; "
                              f"services/worker/vllm/requirements-cpu.txt): {error}") from error
        return VllmEngine(VllmEngineOptions.from_worker_config(config))
    raise ConfigError(f"unknown engine {config.engine!r} (supported: sim, vllm)")


def build_kv(config: WorkerConfig, engine: Engine, bus) -> WorkerKv | None:
    if not config.kv_transfer.enabled:
        return None
    from connector.nixl_agent import nixl_available

    if not nixl_available():
        raise ConfigError("the KV data plane needs NIXL (pip install --no-deps nixl-cu12); "
                          "run with --no-kv-transfer to compute everything locally")
    if config.engine == "vllm":  # the data plane lives in vLLM's engine process (Tandem's connector)
        from services.worker.vllm.worker_kv import VllmWorkerKv

        return VllmWorkerKv(config, bus, engine)
    return WorkerKv(config, bus, engine, build_transport(config, engine), compat_hash=engine.info.compat_hash)


async def run_worker(config: WorkerConfig, *, ready: asyncio.Event | None = None) -> None:
    config.validate()
    setup_tracing(f"tandem-worker-{config.worker_id}", config.tracing.exporter, config.tracing.otlp_endpoint)
    engine = build_engine(config)
    bus = await connect(config.bus.nats_url, f"worker-{config.worker_id}")
    await engine.start()
    service = WorkerService(config, engine, bus, build_kv(config, engine, bus))
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
