"""Options and helpers shared by the service commands: one definition of each common flag
(`--nats-url`, `--namespace`, membership and tracing), the typed config pieces built from
them, how a service's coroutine runs (a config error exits 2, Ctrl-C is quiet), and how a
rendered stack definition is printed or written (compose, Kubernetes).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated

import typer

NatsUrl = Annotated[str, typer.Option("--nats-url", envvar="TANDEM_NATS_URL", help="NATS server URL.")]
Namespace = Annotated[str, typer.Option("--namespace", envvar="TANDEM_NAMESPACE",
                                        help="Subject namespace (one per cluster).")]
# Paths only: the secrets stay in the files (`shared.nats_secrets`, `shared.nats_security`)
NatsCreds = Annotated[str, typer.Option("--nats-creds-file", envvar="TANDEM_NATS_CREDS_FILE",
                                        help="File with this service's NATS user and password.")]
NatsCa = Annotated[str, typer.Option("--nats-ca-file", envvar="TANDEM_NATS_CA_FILE",
                                     help="CA certificate of the NATS server: TLS on.")]
NatsCert = Annotated[str, typer.Option("--nats-cert-file", envvar="TANDEM_NATS_CERT_FILE",
                                       help="Client certificate shown to NATS (TLS).")]
NatsKey = Annotated[str, typer.Option("--nats-key-file", envvar="TANDEM_NATS_KEY_FILE",
                                      help="Key of the client certificate.")]
NatsReplicas = Annotated[int, typer.Option("--nats-replicas", envvar="TANDEM_NATS_REPLICAS",
                                           help="Copies JetStream keeps of each bucket created (3 on a 3-node "
                                                "cluster; --nats-url then lists its servers, comma-separated).")]
Heartbeat = Annotated[float, typer.Option("--heartbeat-interval", help="Seconds between worker heartbeats.")]
Ttl = Annotated[float, typer.Option("--ttl", help="Seconds without heartbeat before a worker is removed.")]
Exporter = Annotated[str, typer.Option("--trace-exporter", envvar="TANDEM_TRACE_EXPORTER",
                                       help="none | otlp | console")]
OtlpEndpoint = Annotated[str, typer.Option("--otlp-endpoint", envvar="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")]
LogLevel = Annotated[str, typer.Option("--log-level", envvar="TANDEM_LOG_LEVEL")]
ApiKeysFile = Annotated[str, typer.Option(
    "--api-keys-file", envvar="TANDEM_API_KEYS_FILE",
    help="API key file (`tandem keys create`): /v1/* needs `Authorization: Bearer <key>`; "
         "reloaded when it changes. Empty: the API is open.")]
MetricsAuth = Annotated[str, typer.Option(
    "--metrics-auth", help="/metrics: open (default: scrapers need no key) or api-key.")]


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str) -> None:
    """Log lines on stderr; a line logged while a request's span is current ends with its
    `trace_id=...`."""
    from shared.tracing import TraceLogFormatter

    handler = logging.StreamHandler()
    handler.setFormatter(TraceLogFormatter(LOG_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def bus_config(nats_url: str, namespace: str, creds_file: str = "", ca_file: str = "", cert_file: str = "",
               key_file: str = "", replicas: int = 1):
    from shared.config import BusConfig
    from shared.nats_auth import has_userinfo

    if has_userinfo(nats_url):
        raise typer.BadParameter("no user or password in the URL (it would show in process lists): "
                                 "use --nats-creds-file", param_hint="--nats-url")
    return BusConfig(nats_url=nats_url, namespace=namespace, creds_file=creds_file, tls_ca_file=ca_file,
                     tls_cert_file=cert_file, tls_key_file=key_file, replicas=replicas)


def membership_config(heartbeat: float, ttl: float):
    from shared.config import MembershipConfig

    return MembershipConfig(heartbeat_interval_s=heartbeat, ttl_s=ttl)


def tracing_config(exporter: str, endpoint: str):
    from shared.config import TracingConfig

    if exporter not in ("none", "otlp", "console"):
        raise typer.BadParameter("must be none, otlp or console", param_hint="--trace-exporter")
    return TracingConfig(exporter=exporter, otlp_endpoint=endpoint)  # type: ignore[arg-type]


def print_rendered(stack: str, output: str, render) -> None:
    """`render` (a stack definition -> text) of the definition at `stack` (default: the
    packaged one), written to `output` or printed; a bad definition is one line, exit 2."""
    from launch.definition import DefinitionError, default_definition_path, load_definition

    try:
        text = render(load_definition(stack or default_definition_path()))
    except DefinitionError as error:
        typer.secho(f"error: {error}", fg="red", err=True)
        raise typer.Exit(2) from None
    if output:
        Path(output).write_text(text)
    else:
        typer.echo(text, nl=False)


def run_service(coro) -> None:
    from shared.config import ConfigError

    try:
        asyncio.run(coro)
    except ConfigError as error:
        typer.secho(f"error: {error}", fg="red", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        pass
