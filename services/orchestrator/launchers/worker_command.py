"""The `tandem worker` arguments of a launched worker, shared by the launchers: the
orchestrator's bus and membership settings, the launcher config's engine and model (written
from a typed `WorkerConfig` by `shared.config_argv`), then the launcher config's extra flags
and the command's own, given as they are (later flags win)."""

from __future__ import annotations

from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.launchers.base import WorkerLaunch
from shared.config import BusConfig, WorkerConfig
from shared.config_argv import config_argv

# Of the orchestrator's bus, only where the cluster is and how many copies its buckets keep:
# a launched worker's NATS user, if any, is its own (the launcher's environment or a slot)
LAUNCHED_WORKER_FIELDS = ("bus.nats_url", "bus.namespace", "bus.replicas", "membership.heartbeat_interval_s",
                          "membership.ttl_s", "worker_id", "role", "engine", "model_dir")


def worker_command(config: OrchestratorConfig, spec: WorkerLaunch) -> list[str]:
    """`worker ...`: what follows the `tandem` program (a process's argv, a container's command)."""
    launcher = config.launcher
    bus = BusConfig(nats_url=config.bus.nats_url, namespace=config.bus.namespace, replicas=config.bus.replicas)
    worker = WorkerConfig(worker_id=spec.worker_id, role=spec.role, engine=launcher.engine,
                          model_dir=launcher.model_dir, bus=bus, membership=config.membership)
    return ["worker", *config_argv(worker, LAUNCHED_WORKER_FIELDS), *launcher.worker_args, *spec.extra_args]


def model_flags(model_dir: str, served_model_name: str) -> tuple[str, ...]:
    """The flags that make a launched worker serve another model than the launcher's."""
    worker = WorkerConfig(worker_id="", model_dir=model_dir, served_model_name=served_model_name)
    return tuple(config_argv(worker, ("model_dir", "served_model_name")))
