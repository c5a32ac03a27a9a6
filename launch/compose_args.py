"""The command lines of a stack's services inside containers, shared by the Docker Compose
renderer (`launch.compose`) and the Kubernetes one (`launch.k8s`): the same options from the
same definition, whatever runs them, written from each service's typed config
(`launch.service_commands`). Pure.

In a container a service listens on every interface (`--host 0.0.0.0`) at the definition's
port; the NATS URL and the model directory are the deployment's. The worker id is the
deployment's too: each replica gets its own (compose: a worker slot it claims, Kubernetes:
the pod's name).
"""

from __future__ import annotations

from dataclasses import dataclass

from launch import service_commands as commands
from launch.definition import StackDefinition, WorkerGroup
from services.metrics.config import MetricsConfig
from services.orchestrator.config import OrchestratorConfig
from services.router.config import RouterConfig
from shared.config import BusConfig, MembershipConfig, WorkerConfig, WorkerSlotsConfig

LISTEN_ALL = "0.0.0.0"


@dataclass(frozen=True, slots=True)
class ContainerArgs:
    definition: StackDefinition
    nats_url: str
    model_dir: str

    def _bus(self) -> BusConfig:
        return commands.cluster_bus(self.nats_url, self.definition.namespace)

    def _membership(self) -> MembershipConfig:
        membership = self.definition.membership
        return commands.cluster_membership(membership.heartbeat_interval_s, membership.ttl_s)

    def orchestrator(self) -> list[str]:
        orchestrator = OrchestratorConfig(bus=self._bus(), membership=self._membership())
        return commands.ORCHESTRATOR_COMMAND.argv(orchestrator, commands.CLUSTER_FIELDS, self.definition.orchestrator.settings)

    def metrics(self) -> list[str]:
        metrics = self.definition.metrics
        config = MetricsConfig(bus=self._bus(), host=LISTEN_ALL, port=metrics.port)
        return commands.METRICS_COMMAND.argv(config, commands.METRICS_FIELDS, metrics.settings)

    def router(self) -> list[str]:
        router = self.definition.router
        config = RouterConfig(bus=self._bus(), membership=self._membership(), host=LISTEN_ALL, port=router.port, model_dir=self.model_dir)
        return commands.ROUTER_COMMAND.argv(config, commands.ROUTER_FIELDS, router.settings)

    def worker(self, group: WorkerGroup, engine: str = "", *, worker_id: str = "",
               slots: WorkerSlotsConfig = WorkerSlotsConfig()) -> list[str]:
        """A worker of `group` (`engine`: instead of the group's own), with `worker_id` where
        given, then its settings and the `slots` it claims one of."""
        config = WorkerConfig(bus=self._bus(), membership=self._membership(), worker_id=worker_id, role=group.role,
                              engine=engine or group.engine, model_dir=self.model_dir)
        own_id = ("worker_id",) if worker_id else ()
        return [*commands.WORKER_COMMAND.argv(config, (*commands.WORKER_FIELDS, *own_id), group.settings), *slot_flags(slots)]


def slot_flags(slots: WorkerSlotsConfig) -> list[str]:
    """`slots`' flags, those set (`shared.worker_slots`): a worker claims one of them when it starts."""
    fields = [f"slots.{name}" for name in ("directory", "nats_dir") if getattr(slots, name)]
    return commands.WORKER_COMMAND.flags(WorkerConfig(worker_id="", slots=slots), fields)
