"""The worker's command configs: `WorkerCommandConfig` (`tandem worker`: the worker's own
config, `shared.config.WorkerConfig`, which launchers and the connector read too, and each
engine's own options, named by its `EngineSpec`) and `FleetConfig` (`tandem worker-fleet`,
`services.worker.fleet`)."""

from __future__ import annotations

from typing import Any

import msgspec

from services.worker.engines import ENGINES, engine_spec
from services.worker.sim.config import SimEngineConfig
from shared.config import WorkerConfig, require


class _WorkerCommand(msgspec.Struct, kw_only=True, frozen=True):
    worker: WorkerConfig

    def engine_config(self) -> Any:
        """The options of the worker's engine (`--engine`): its part of this config."""
        return getattr(self, engine_spec(self.worker.engine).name)

    def validate(self) -> None:
        self.worker.validate()
        self.engine_config().validate()


# `tandem worker`'s config: `worker` (a `WorkerConfig`), then one part per registered engine,
# named after it and typed by its `EngineSpec.config_type` (`sim`: `SimEngineConfig`, `vllm`:
# `VllmEngineConfig`). A new engine's options join it from the engine's own spec. The flags
# of every part keep their names (`--sim-speedup`, `--vllm-block-size`).
WorkerCommandConfig: Any = msgspec.defstruct(
    "WorkerCommandConfig", [(name, spec.config_type, spec.config_type()) for name, spec in ENGINES.items()],
    bases=(_WorkerCommand,), kw_only=True, frozen=True, module=__name__)


class FleetConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Many simulated workers in one process: each is `worker` (its `worker_id` ignored) under
    the id `id_prefix` + its index, with its own registration, KV pool, events and subjects;
    they share `connections` NATS connections and one ticker for their heartbeats, KV event
    flushes and load snapshots."""

    worker: WorkerConfig  # the template every worker of the fleet is made from
    sim: SimEngineConfig = SimEngineConfig()  # the simulated engine's options, the same for every worker
    count: int = 16
    id_prefix: str = "sim-"
    first_index: int = 0
    connections: int = 1  # NATS connections the workers share, round-robin
    start_concurrency: int = 64  # workers starting (or stopping) at once

    def worker_id(self, index: int) -> str:
        return f"{self.id_prefix}{index:04d}"

    def worker_config(self, index: int) -> WorkerConfig:
        return msgspec.structs.replace(self.worker, worker_id=self.worker_id(index))

    def validate(self) -> None:
        require(self.count > 0, "a fleet needs at least one worker")
        require(self.first_index >= 0, "the first index must not be negative")
        require(self.connections > 0, "a fleet needs at least one NATS connection")
        require(self.start_concurrency > 0, "start concurrency must be positive")
        in_fleet = [name for name, spec in ENGINES.items() if spec.deployment.in_fleet]
        require(engine_spec(self.worker.engine).deployment.in_fleet,
                f"a fleet runs {' or '.join(in_fleet)} workers only (--engine {in_fleet[0]})")
        self.sim.validate()
        self.worker_config(self.first_index).validate()
        self.worker_config(self.first_index + self.count - 1).validate()
