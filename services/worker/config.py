"""The worker fleet's config (`tandem worker-fleet`, `services.worker.fleet`); a worker's own
config is `shared.config.WorkerConfig` (the connector reads it too)."""

from __future__ import annotations

import msgspec

from shared.config import WorkerConfig, require


class FleetConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Many simulated workers in one process: each is `worker` (its `worker_id` ignored) under
    the id `id_prefix` + its index, with its own registration, KV pool, events and subjects;
    they share `connections` NATS connections and one ticker for their heartbeats, KV event
    flushes and load snapshots."""

    worker: WorkerConfig  # the template every worker of the fleet is made from
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
        from services.worker.engines import ENGINES, engine_spec  # the registry imports no engine

        in_fleet = [name for name, spec in ENGINES.items() if spec.deployment.in_fleet]
        require(engine_spec(self.worker.engine).deployment.in_fleet,
                f"a fleet runs {' or '.join(in_fleet)} workers only (--engine {in_fleet[0]})")
        self.worker_config(self.first_index).validate()
        self.worker_config(self.first_index + self.count - 1).validate()
