"""The service commands a launcher starts (`tandem router|worker|orchestrator|metrics`): each
command's typed config and the config fields it takes no flag for. `cli.services` makes the
commands' options from this table (`cli.config_options`); the launchers write the commands'
argv with it (`shared.config_argv`), so both sides name every option alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from services.metrics.config import MetricsConfig
from services.orchestrator.config import OrchestratorConfig
from services.router.config import RouterConfig
from services.worker.config import WorkerCommandConfig
from shared.config import BusConfig, MembershipConfig, WorkerConfig
from shared.config_argv import config_argv, options_argv


@dataclass(frozen=True, slots=True)
class ServiceCommand:
    name: str  # `tandem <name>`
    config_type: type  # what the command parses its options into
    exclude: tuple[str, ...] = ()  # fields that get no option: they keep their defaults
    # The part of `config_type` launchers write field by field (`flags`), where not all of it:
    # the worker's own config (`WorkerConfig`), its engines' options going by name (settings)
    written_type: type | None = None

    def flags(self, config: Any, fields: Iterable[str]) -> list[str]:
        """The flags of `config`'s `fields` (dotted paths), whatever their values: a field left
        out keeps its default, or the value of its `TANDEM_*` variable where the process has one."""
        written = self.written_type or self.config_type
        assert isinstance(config, written), f"{self.name} writes a {written.__name__}"
        return config_argv(config, fields, exclude=self.exclude)

    def setting_flags(self, settings: Mapping[str, Any]) -> list[str]:
        """A stack definition's settings (options by name) as this command's flags."""
        return options_argv(self.config_type, settings, exclude=self.exclude)

    def argv(self, config: Any, fields: Iterable[str], settings: Mapping[str, Any]) -> list[str]:
        """`tandem <name>`'s arguments: `config`'s `fields`, then the definition's `settings`
        (after them, so that they win)."""
        return [self.name, *self.flags(config, fields), *self.setting_flags(settings)]


ROUTER_COMMAND = ServiceCommand("router", RouterConfig)
# a flag of `WorkerConfig` is named alike in `WorkerCommandConfig`, which adds the engines' options
WORKER_COMMAND = ServiceCommand("worker", WorkerCommandConfig, written_type=WorkerConfig)
ORCHESTRATOR_COMMAND = ServiceCommand("orchestrator", OrchestratorConfig)
# The collector reads no heartbeats and exports no traces: no flags for them
METRICS_COMMAND = ServiceCommand("metrics", MetricsConfig, exclude=("membership", "tracing"))
SERVICE_COMMANDS = (ROUTER_COMMAND, WORKER_COMMAND, ORCHESTRATOR_COMMAND, METRICS_COMMAND)

# What every launcher sets of each service it starts, always written (an inherited TANDEM_*
# variable never changes it): the cluster's bus and, for services that hear heartbeats, its
# membership timing
BUS_FIELDS = ("bus.nats_url", "bus.namespace")
MEMBERSHIP_FIELDS = ("membership.heartbeat_interval_s", "membership.ttl_s")
CLUSTER_FIELDS = (*BUS_FIELDS, *MEMBERSHIP_FIELDS)
# and of the services that listen (on a host and port of the launcher's) or load a model
METRICS_FIELDS = (*BUS_FIELDS, "host", "port")
ROUTER_FIELDS = (*CLUSTER_FIELDS, "host", "port", "model_dir")
WORKER_FIELDS = (*CLUSTER_FIELDS, "role", "engine", "model_dir")


def cluster_bus(nats_url: str, namespace: str) -> BusConfig:
    return BusConfig(nats_url=nats_url, namespace=namespace)


def cluster_membership(heartbeat_interval_s: float, ttl_s: float) -> MembershipConfig:
    return MembershipConfig(heartbeat_interval_s=heartbeat_interval_s, ttl_s=ttl_s)
