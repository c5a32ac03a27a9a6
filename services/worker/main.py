"""Wiring for the worker: config (the worker's and its engine's) -> engine -> service, until SIGTERM/SIGINT, a Drain, or the
engine's death (the worker leaves the cluster at once and exits non-zero: `EngineFailed`). With
worker slots (`WorkerConfig.slots`) it first claims one, runs under its id and NATS user, and
holds it until it exits."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import msgspec

from services.worker.config import WorkerCommandConfig
from services.worker.engine import Engine, EngineFailed
from services.worker.engine_spec import EngineSpec
from services.worker.engines import engine_spec
from services.worker.service import WorkerService
from shared.bus import Bus, connect
from shared.config import ConfigError, WorkerConfig
from shared.lifecycle import stop_on_signals
from shared.nats_auth import Role, user_name
from shared.nats_security import user_files
from shared.tracing import setup_tracing
from shared.worker_slots import SlotRefused, claim_slot

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


def slot_config(config: WorkerConfig, worker_id: str) -> WorkerConfig:
    """`config` for the slot `worker_id`: its id, and with `slots.nats_dir` its own NATS user's files."""
    bus = config.bus
    if config.slots.nats_dir:
        files = user_files(config.slots.nats_dir, user_name(Role.WORKER, worker_id),
                           tls=Path(config.slots.nats_dir, "tls").is_dir())
        if not Path(files["creds_file"]).is_file():
            raise ConfigError(f"worker slot {worker_id} has no NATS user in {config.slots.nats_dir}: the slots "
                              f"and the users were not made together (make them again)")
        bus = msgspec.structs.replace(bus, **files)
    return msgspec.structs.replace(config, worker_id=worker_id, bus=bus)


async def run_worker(command: WorkerCommandConfig, *, ready: asyncio.Event | None = None) -> None:
    """`tandem worker`: `command.worker` serving its engine, built with the engine's own
    options (`command.engine_config()`)."""
    config = command.worker
    if not config.slots.directory:
        await _run(config, command.engine_config(), ready)
        return
    claim = claim_slot(config.slots.directory, config.worker_id)
    if isinstance(claim, SlotRefused):
        raise ConfigError(claim.reason)
    with claim:  # held until the worker is done; the kernel lets go if the process dies
        log.info("worker slot %s claimed in %s", claim.worker_id, config.slots.directory)
        await _run(slot_config(config, claim.worker_id), command.engine_config(), ready)


async def _run(config: WorkerConfig, engine_config: Any, ready: asyncio.Event | None) -> None:
    config.validate()
    engine_config.validate()
    setup_tracing(f"tandem-worker-{config.worker_id}", config.tracing.exporter, config.tracing.otlp_endpoint)
    spec = engine_spec(config.engine)
    engine = spec.build_engine(config, engine_config)
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
            failed = asyncio.create_task(engine.wait_failed())
            await asyncio.wait({stopped, requested, failed}, return_when=asyncio.FIRST_COMPLETED)
            for task in (stopped, requested, failed):
                task.cancel()
            if failed.done() and not failed.cancelled() and not service.stopped.is_set():
                why = failed.result()
                await service.leave_now(why)
                raise EngineFailed(f"worker {config.worker_id}: {why}")
            if not service.stopped.is_set():
                log.info("worker %s stopping: draining %d in-flight request(s)", config.worker_id, service.inflight)
                await service.stop()
    finally:
        await bus.close()
