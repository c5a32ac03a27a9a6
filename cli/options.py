"""Options and helpers shared by the commands: the bus flags one by one (made from
`shared.config.BusConfig`'s fields) and the bus config built from them, `--log-level`, how a
service's coroutine runs (a config error exits 2, Ctrl-C is quiet), and how a rendered stack
definition is printed or written (compose, Kubernetes).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated

import typer

from cli.config_options import field_option
from shared.config import BusConfig, ConfigError, checked_nats_url

# One definition of each bus flag, for commands that take them one by one (`tandem ctl`)
NatsUrl = field_option(BusConfig, "nats_url")
Namespace = field_option(BusConfig, "namespace")
NatsCreds = field_option(BusConfig, "creds_file")
NatsCa = field_option(BusConfig, "tls_ca_file")
NatsCert = field_option(BusConfig, "tls_cert_file")
NatsKey = field_option(BusConfig, "tls_key_file")
LogLevel = Annotated[str, typer.Option("--log-level", envvar="TANDEM_LOG_LEVEL")]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str) -> None:
    """Log lines on stderr; a line logged while a request's span is current ends with its
    `trace_id=...`."""
    from shared.tracing import TraceLogFormatter

    handler = logging.StreamHandler()
    handler.setFormatter(TraceLogFormatter(LOG_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def bus_config(nats_url: str, namespace: str, creds_file: str = "", ca_file: str = "", cert_file: str = "",
               key_file: str = "") -> BusConfig:
    try:
        checked_nats_url(nats_url)
    except ConfigError as error:
        raise typer.BadParameter(str(error), param_hint="--nats-url") from None
    return BusConfig(nats_url=nats_url, namespace=namespace, creds_file=creds_file, tls_ca_file=ca_file,
                     tls_cert_file=cert_file, tls_key_file=key_file)


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
    try:
        asyncio.run(coro)
    except ConfigError as error:
        typer.secho(f"error: {error}", fg="red", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        pass
