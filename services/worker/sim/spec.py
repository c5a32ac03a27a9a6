"""The sim engine's registration (see services/worker/engines.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.worker.engine_spec import EngineDeployment, EngineSpec
from services.worker.sim.config import SimEngineConfig
from shared.config import ConfigError, WorkerConfig
from shared.config_fields import flag_name
from shared.schemas.membership import EngineCapabilities

if TYPE_CHECKING:
    from services.worker.engine import Engine
    from shared.bus import Bus


def build_engine(config: WorkerConfig, sim: SimEngineConfig) -> Engine:
    from services.worker.sim.engine import SimEngine
    from shared.tokenizer import Tokenizer

    if not config.model_dir:
        raise ConfigError(f"the sim engine needs a model directory for its tokenizer ({flag_name(WorkerConfig, 'model_dir')})")
    tokenizer = Tokenizer.from_model_dir(config.model_dir)
    model_name = config.served_model_name or tokenizer.model_name
    return SimEngine(config, sim, model_name=model_name, vocab_size=tokenizer.vocab_size)


def build_data_plane(config: WorkerConfig, engine: Engine, bus: Bus):
    from connector.sim.transport_builder import build_rank_transports
    from connector.sim.worker_kv import WorkerKv

    return WorkerKv(config, bus, engine, build_rank_transports(config, engine), compat_hash=engine.info.compat_hash)


SIM = EngineSpec(
    name="sim",
    summary="simulated engine: paged KV, prefix cache, batching, timing profile (no model weights run)",
    capabilities=EngineCapabilities(kv_pull=True, kv_push=True, adapter_kv_transfer=True,
                                    host_tier_lending=True),
    config_type=SimEngineConfig,
    build_engine=build_engine,
    build_data_plane=build_data_plane,
    deployment=EngineDeployment(in_fleet=True),
)
