"""The service commands: `tandem nats|router|orchestrator|metrics|worker`. Each builds its
service's typed config once from flags (and `TANDEM_*` environment variables) and runs it;
the flags are the config's flag fields (`cli.config_options`), so a new knob is a new field.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Optional

import typer

from cli.config_options import config_options
from cli.options import LogLevel, Namespace, run_service, setup_logging
from launch.service_commands import METRICS_COMMAND, SERVICE_COMMANDS
from services.metrics.config import MetricsConfig
from services.orchestrator.config import OrchestratorConfig
from services.router.config import RouterConfig
from services.worker.config import WorkerCommandConfig
from shared.config import ConfigError
from shared.config_fields import flag_name

app = typer.Typer()


@app.command()
def nats(
    port: Annotated[int, typer.Option(help="Port; -1 picks a free one.")] = -1,
    store_dir: Annotated[Optional[str], typer.Option(help="JetStream store directory.")] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    security_dir: Annotated[str, typer.Option(
        help="Secure it: a user per service with its permissions, and TLS; the credentials files, "
             "certificates and server config are made (afresh) in this directory.")] = "",
    worker_id: Annotated[Optional[list[str]], typer.Option(help="A worker to make a user for (repeat).")] = None,
    tls_host: Annotated[Optional[list[str]], typer.Option(
        help="A host name or address clients dial, for the server certificate (repeat).")] = None,
    namespace: Namespace = "tandem",
) -> None:
    """Run the embedded nats-server (JetStream on) in the foreground."""
    import signal

    from shared.nats_security import NatsSecurity
    from shared.nats_server import EmbeddedNats

    security = None
    if security_dir:
        hosts = tuple(tls_host or ()) + ("127.0.0.1", "localhost", "::1")
        security = NatsSecurity.create(security_dir, namespace, worker_id or [], hosts=hosts)
        typer.echo(f"users and certificates in {security_dir} (server config {security.server_config_file})")
    server = EmbeddedNats(store_dir, host=host, port=port, config_file=security and security.server_config_file,
                          tls=security is not None).start()
    typer.echo(f"nats-server listening on {server.url}")
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)  # after the child started: it keeps its mask
    try:
        signal.sigwait(stop_signals)
    finally:
        server.stop()


@app.command()
@config_options("config", RouterConfig)
def router(config: RouterConfig, log_level: LogLevel = "info") -> None:
    """Run the router: OpenAI-compatible HTTP API in front of the workers."""
    from services.router.main import run_router
    from services.router.routing import policy_spec

    setup_logging(log_level)
    if not config.model_dir:
        raise typer.BadParameter("a model directory is required (its tokenizer is used)",
                                 param_hint=flag_name(RouterConfig, "model_dir"))
    _validate(config)
    try:
        policy_spec(config.routing.policy)
    except ConfigError as error:
        raise typer.BadParameter(str(error)) from None
    try:
        result = run_router(config)
    except ConfigError as error:  # an unusable API key file, or NATS refused it (credentials, TLS)
        typer.secho(f"error: {error}", fg="red", err=True)
        raise typer.Exit(2) from None
    if asyncio.iscoroutine(result):
        run_service(result)


@app.command()
@config_options("config", OrchestratorConfig)
def orchestrator(config: OrchestratorConfig, log_level: LogLevel = "info") -> None:
    """Run the orchestrator: owns membership, removes workers whose heartbeats stop, and
    carries out `tandem ctl` commands (cordon, drain, set-role, add, remove); with --planner,
    runs the SLO planner, which switches roles, adds and removes workers (see docs/planner.md)."""
    from services.orchestrator.main import run_orchestrator

    setup_logging(log_level)
    _validate(config)
    run_service(run_orchestrator(config))


@app.command()
@config_options("config", MetricsConfig, exclude=METRICS_COMMAND.exclude)
def metrics(config: MetricsConfig, log_level: LogLevel = "info") -> None:
    """Run the metrics collector: cluster view as Prometheus metrics and JSON."""
    from services.metrics.main import run_metrics

    setup_logging(log_level)
    _validate(config)
    run_service(run_metrics(config))


@app.command()
@config_options("config", WorkerCommandConfig)
def worker(config: WorkerCommandConfig, log_level: LogLevel = "info") -> None:
    """Run an engine worker that serves one engine on NATS."""
    from services.worker.engine import ENGINE_FAILED_EXIT, EngineFailed
    from services.worker.engines import engine_names
    from services.worker.main import run_worker

    setup_logging(log_level)
    if not config.worker.worker_id and not config.worker.slots.directory:
        raise typer.BadParameter("a worker id is needed (or --worker-slots)", param_hint="--worker-id")
    if config.worker.engine not in engine_names():
        raise typer.BadParameter(f"must be one of: {', '.join(engine_names())}", param_hint="--engine")
    try:  # validated when it starts (with slots, under the claimed slot's id)
        run_service(run_worker(config))
    except EngineFailed as error:  # the worker left the cluster already; its launcher may restart it
        typer.secho(f"error: {error}", fg="red", err=True)
        raise typer.Exit(ENGINE_FAILED_EXIT) from None


# The service commands' configs, and the fields that get no flag, in the flag reference's order
# (`cli.flag_reference`): the launchers write their command lines from the same table
SERVICE_CONFIGS: tuple[tuple[str, type, tuple[str, ...]], ...] = tuple(
    (command.name, command.config_type, command.exclude) for command in SERVICE_COMMANDS)


def _validate(config: RouterConfig | OrchestratorConfig | MetricsConfig) -> None:
    try:
        config.validate()
    except ConfigError as error:
        raise typer.BadParameter(str(error)) from None


@app.command()
def engines() -> None:
    """List the engines a worker can run, and whether this Python can run each."""
    from services.worker.engines import engine_names, engine_spec

    for name in engine_names():
        spec = engine_spec(name)
        problem = spec.problem()
        typer.echo(f"{name}: {spec.summary}" + (f"\n  not here: {problem}" if problem else ""))
