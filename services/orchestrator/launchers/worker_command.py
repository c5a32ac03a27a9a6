"""The `tandem worker` arguments of a launched worker, shared by the launchers: the
orchestrator's bus and membership settings, the launcher config's engine, model and extra
flags, then the command's own (later flags win)."""

from __future__ import annotations

from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.launchers.base import WorkerLaunch


def worker_command(config: OrchestratorConfig, spec: WorkerLaunch) -> list[str]:
    """`worker ...`: what follows the `tandem` program (a process's argv, a container's command)."""
    launcher, membership = config.launcher, config.membership
    return ["worker", "--nats-url", config.bus.nats_url, "--namespace", config.bus.namespace,
            "--nats-replicas", str(config.bus.replicas),
            "--heartbeat-interval", str(membership.heartbeat_interval_s), "--ttl", str(membership.ttl_s),
            "--worker-id", spec.worker_id, "--role", spec.role.value,
            "--engine", launcher.engine, "--model-dir", launcher.model_dir, *launcher.worker_args,
            *spec.extra_args]
