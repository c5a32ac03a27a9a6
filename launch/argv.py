"""A local stack's services as `tandem <service>` command lines (the local launcher's
rendering of a `StackConfig`): an engine's launch options first, then settings as options (`kv_lease_ttl = 3` ->
`--kv-lease-ttl 3`, `kv_transfer = false` -> `--no-kv-transfer`), verbatim flags come last
so they win over what came before.
"""

from __future__ import annotations

from launch.definition import Settings
from launch.plan import StackConfig, WorkerSpec


def setting_flags(settings: Settings) -> list[str]:
    flags: list[str] = []
    for name, value in settings.items():
        option = name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{option}" if value else f"--no-{option}")
        else:
            flags += [f"--{option}", str(value)]
    return flags


def _bus(config: StackConfig, nats_url: str) -> list[str]:
    return ["--nats-url", nats_url, "--namespace", config.namespace]


def _membership(config: StackConfig) -> list[str]:
    return ["--heartbeat-interval", str(config.heartbeat_interval_s), "--ttl", str(config.ttl_s)]


def _scalable_models(config: StackConfig) -> list[str]:
    """The one list of scalable models, given alike to the router and the orchestrator."""
    return [flag for name, directory in sorted(config.scalable_models.items())
            for flag in ("--scalable-model", f"{name}={directory}")]


def orchestrator_args(config: StackConfig, nats_url: str) -> list[str]:
    return ["orchestrator", *_bus(config, nats_url), *_membership(config), *_scalable_models(config),
            *setting_flags(config.orchestrator_settings)]


def metrics_args(config: StackConfig, nats_url: str, port: int) -> list[str]:
    return ["metrics", *_bus(config, nats_url), "--host", config.metrics_host, "--port", str(port),
            *setting_flags(config.metrics_settings)]


def router_args(config: StackConfig, nats_url: str, port: int) -> list[str]:
    return ["router", *_bus(config, nats_url), *_membership(config), "--host", config.router_host,
            "--port", str(port), "--model-dir", config.model_dir, *_scalable_models(config),
            *setting_flags(config.router_settings),
            *config.router_args]


def worker_args(config: StackConfig, nats_url: str, spec: WorkerSpec) -> list[str]:
    return ["worker", *_bus(config, nats_url), *_membership(config), "--worker-id", spec.worker_id,
            "--role", spec.role.value, "--engine", config.worker_engine(spec), "--model-dir", spec.model_dir or config.model_dir,
            *spec.engine_args, *setting_flags(spec.settings), *spec.extra_args]
