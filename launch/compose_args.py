"""The command lines of a stack's services inside containers, shared by the Docker Compose
renderer (`launch.compose`) and the Kubernetes one (`launch.k8s`): the same options from the
same definition, whatever runs them. Pure.

In a container a service listens on every interface (`--host 0.0.0.0`) at the definition's
port; the NATS URL and the model directory are the deployment's. The worker id is not here:
each deployment gives every replica its own (compose: the container's host name,
Kubernetes: the pod's name).
"""

from __future__ import annotations

from dataclasses import dataclass

from launch.argv import setting_flags
from launch.definition import StackDefinition, WorkerGroup

LISTEN_ALL = "0.0.0.0"


@dataclass(frozen=True, slots=True)
class ContainerArgs:
    definition: StackDefinition
    nats_url: str
    model_dir: str

    def bus(self) -> list[str]:
        return ["--nats-url", self.nats_url, "--namespace", self.definition.namespace]

    def membership(self) -> list[str]:
        membership = self.definition.membership
        return ["--heartbeat-interval", str(membership.heartbeat_interval_s), "--ttl", str(membership.ttl_s)]

    def orchestrator(self) -> list[str]:
        return ["orchestrator", *self.bus(), *self.membership(), *setting_flags(self.definition.orchestrator.settings)]

    def metrics(self) -> list[str]:
        metrics = self.definition.metrics
        return ["metrics", *self.bus(), "--host", LISTEN_ALL, "--port", str(metrics.port),
                *setting_flags(metrics.settings)]

    def router(self) -> list[str]:
        router = self.definition.router
        return ["router", *self.bus(), *self.membership(), "--host", LISTEN_ALL, "--port", str(router.port),
                "--model-dir", self.model_dir, *setting_flags(router.settings)]

    def worker(self, group: WorkerGroup, engine: str = "") -> list[str]:
        """A worker of `group` (`engine`: instead of the group's own), without its id."""
        return ["worker", *self.bus(), *self.membership(), "--role", group.role.value,
                "--engine", engine or group.engine, "--model-dir", self.model_dir, *setting_flags(group.settings)]
