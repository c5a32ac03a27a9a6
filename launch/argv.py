"""A local stack's services as `tandem <service>` command lines (the local launcher's
rendering of a `StackConfig`), written from each service's typed config
(`launch.service_commands`, `shared.config_argv`): what the stack sets of a service first,
then an engine's launch options, then the definition's settings as options (`kv_lease_ttl = 3`
-> `--kv-lease-ttl 3.0`, `kv_transfer = false` -> `--no-kv-transfer`); verbatim flags come
last so they win over what came before.
"""

from __future__ import annotations

from launch.plan import StackConfig, WorkerSpec
from launch.service_commands import (
    CLUSTER_FIELDS,
    METRICS_COMMAND,
    METRICS_FIELDS,
    ORCHESTRATOR_COMMAND,
    ROUTER_COMMAND,
    ROUTER_FIELDS,
    WORKER_COMMAND,
    WORKER_FIELDS,
    cluster_bus,
    cluster_membership,
)
from services.metrics.config import MetricsConfig
from services.orchestrator.config import OrchestratorConfig, ScaleToZeroConfig
from services.router.config import RouterConfig, ScaleFromZeroConfig
from shared.config import WorkerConfig

# The fields the local stack sets of each service (dotted paths of its config), always
# written: every launcher's (`launch.service_commands`), the scalable models and a worker's id
LOCAL_ORCHESTRATOR_FIELDS = (*CLUSTER_FIELDS, "scale_to_zero.models")
LOCAL_ROUTER_FIELDS = (*ROUTER_FIELDS, "scale_from_zero.models")
LOCAL_WORKER_FIELDS = (*WORKER_FIELDS, "worker_id")


def _scalable_models(config: StackConfig) -> tuple[str, ...]:
    """The one list of scalable models, given alike to the router and the orchestrator."""
    return tuple(f"{name}={directory}" for name, directory in sorted(config.scalable_models.items()))


def orchestrator_args(config: StackConfig, nats_url: str) -> list[str]:
    orchestrator = OrchestratorConfig(bus=cluster_bus(nats_url, config.namespace),
                                      membership=cluster_membership(config.heartbeat_interval_s, config.ttl_s),
                                      scale_to_zero=ScaleToZeroConfig(models=_scalable_models(config)))
    return ORCHESTRATOR_COMMAND.argv(orchestrator, LOCAL_ORCHESTRATOR_FIELDS, config.orchestrator_settings)


def metrics_args(config: StackConfig, nats_url: str, port: int) -> list[str]:
    metrics = MetricsConfig(bus=cluster_bus(nats_url, config.namespace), host=config.metrics_host, port=port)
    return METRICS_COMMAND.argv(metrics, METRICS_FIELDS, config.metrics_settings)


def router_args(config: StackConfig, nats_url: str, port: int, instance_port: int | None = None) -> list[str]:
    """A router on `port`; with `instance_port`, one of several sharing it (SO_REUSEPORT), also
    listening alone on that port."""
    router = RouterConfig(bus=cluster_bus(nats_url, config.namespace),
                          membership=cluster_membership(config.heartbeat_interval_s, config.ttl_s),
                          host=config.router_host, port=port, model_dir=config.model_dir,
                          scale_from_zero=ScaleFromZeroConfig(models=_scalable_models(config)),
                          reuse_port=instance_port is not None, instance_port=instance_port)
    replica = ("reuse_port", "instance_port") if instance_port is not None else ()
    return [*ROUTER_COMMAND.argv(router, LOCAL_ROUTER_FIELDS, config.router_settings), *config.router_args,
            *ROUTER_COMMAND.flags(router, replica)]


def worker_args(config: StackConfig, nats_url: str, spec: WorkerSpec, *, restarts: int = 0,
                last_exit: str = "") -> list[str]:
    """`spec`'s worker; a restarted one (`restarts` > 0) also says how its predecessor ended."""
    worker = WorkerConfig(worker_id=spec.worker_id, role=spec.role, engine=config.worker_engine(spec),
                          model_dir=spec.model_dir or config.model_dir,
                          bus=cluster_bus(nats_url, config.namespace),
                          membership=cluster_membership(config.heartbeat_interval_s, config.ttl_s),
                          restarts=restarts, last_exit=last_exit)
    restarted = ("restarts", "last_exit") if restarts else ()
    return [WORKER_COMMAND.name, *WORKER_COMMAND.flags(worker, LOCAL_WORKER_FIELDS),
            *spec.engine_args, *WORKER_COMMAND.setting_flags(spec.settings), *spec.extra_args,
            *WORKER_COMMAND.flags(worker, restarted)]
