"""One local stack's service instances: a `StackDefinition` expanded worker by worker.

`plan_stack(definition, ...)` gives the `StackConfig` that `LocalStack` runs: each worker
group becomes `count` `WorkerSpec`s, each with the per-worker launch options its engine
asks for (`EngineSpec.launch_args`, e.g. one CPU core per vLLM engine). Tests and
benchmarks may also build a `StackConfig` directly, worker by worker.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from launch.definition import Settings, StackDefinition, checked
from shared.schemas import WorkerRole


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    role: WorkerRole = WorkerRole.BOTH
    engine: str = ""  # empty: the stack's engine
    engine_args: tuple[str, ...] = ()  # the engine's per-worker launch options; settings may override them
    settings: Settings = {}
    extra_args: tuple[str, ...] = ()  # `tandem worker` flags given as they are, after the settings
    model_dir: str = ""  # the model it serves; empty: the stack's (a router serves every model its workers register)


class StackConfig(msgspec.Struct, frozen=True, kw_only=True):
    model_dir: str
    engine: str = "sim"  # of workers that name none
    workers: tuple[WorkerSpec, ...] = (WorkerSpec(worker_id="worker-1"), WorkerSpec(worker_id="worker-2"))
    router_host: str = "127.0.0.1"
    router_port: int = 8000  # 0: a free port
    router_health: str = "/health"
    router_settings: Settings = {}
    router_args: tuple[str, ...] = ()  # `tandem router` flags given as they are (routing policy settings)
    routers: int = 1  # router processes sharing the router's port (SO_REUSEPORT) and their predicted load
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    metrics_health: str = "/metrics"
    metrics_settings: Settings = {}
    orchestrator_settings: Settings = {}
    # models that may have zero workers, name -> model directory, or DIR@1p1d for a model that wakes
    # disaggregated (`shared.scalable_models`): the router lists them and holds their requests, the
    # orchestrator starts their workers (its launcher) and stops idle ones
    scalable_models: dict[str, str] = {}
    nats_url: str = ""  # empty: start an embedded nats-server
    # set: that embedded server is secured (users, permissions, TLS), its files made here
    nats_security_dir: str = ""
    namespace: str = "tandem"
    heartbeat_interval_s: float = 0.5
    ttl_s: float = 3.0
    log_dir: str = ".tandem/logs"
    start_timeout_s: float = 0.0  # 0: the slowest of the engines' start timeouts

    def worker_engine(self, spec: WorkerSpec) -> str:
        return spec.engine or self.engine

    def engines(self) -> list[str]:
        return list(dict.fromkeys(self.worker_engine(spec) for spec in self.workers)) or [self.engine]

    def resolved_start_timeout_s(self) -> float:
        if self.start_timeout_s > 0:
            return self.start_timeout_s
        from services.worker.engines import engine_spec

        return max(engine_spec(engine).start_timeout_s for engine in self.engines())


def worker_specs(definition: StackDefinition, cores: Sequence[int] = ()) -> tuple[WorkerSpec, ...]:
    """Every worker of the definition, group by group; the engine's launch options of the
    worker at position i (counted over the whole stack) use `cores`."""
    from services.worker.engines import engine_spec

    named = [(f"{group.name}-{number + 1}", group) for group in definition.workers for number in range(group.count)]
    return tuple(WorkerSpec(worker_id=worker_id, role=group.role, engine=group.engine, settings=group.settings,
                            engine_args=engine_spec(group.engine).launch_args(index, cores))
                 for index, (worker_id, group) in enumerate(named))


def plan_stack(definition: StackDefinition, *, log_dir: str, cores: Sequence[int] = (),
               start_timeout_s: float = 0.0) -> StackConfig:
    """The instances of `definition` for one local stack. Its `model_dir` must be set."""
    definition = checked(definition, definition.name)
    if not definition.model_dir:
        raise ValueError("the stack needs a model directory")
    router, metrics = definition.router, definition.metrics
    workers = worker_specs(definition, cores)
    return StackConfig(
        model_dir=definition.model_dir,
        engine=workers[0].engine if workers else "sim",
        workers=workers,
        router_host=router.host, router_port=router.port, router_health=router.health,
        router_settings=router.settings, routers=definition.routers,
        metrics_host=metrics.host, metrics_port=metrics.port, metrics_health=metrics.health,
        metrics_settings=metrics.settings,
        orchestrator_settings=definition.orchestrator.settings,
        nats_url=definition.nats.url,
        namespace=definition.namespace,
        heartbeat_interval_s=definition.membership.heartbeat_interval_s,
        ttl_s=definition.membership.ttl_s,
        log_dir=log_dir,
        start_timeout_s=start_timeout_s,
    )
