"""A started sim worker for the integration tests that need a real `WorkerService` (no KV
data plane) and nothing more: the tests own the bus connection it serves on and stop it."""

from __future__ import annotations

from services.worker.service import WorkerService
from services.worker.sim.config import SimEngineConfig
from services.worker.sim.engine import SimEngine
from shared.bus import Bus
from shared.config import WorkerConfig


async def start_sim_worker(config: WorkerConfig, bus: Bus, sim: SimEngineConfig = SimEngineConfig()) -> WorkerService:
    engine = SimEngine(config, sim, model_name="tiny", vocab_size=512)
    await engine.start()
    service = WorkerService(config, engine, bus)
    await service.start()
    return service
