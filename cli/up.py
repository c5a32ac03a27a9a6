"""`tandem up`: a stack definition run as local processes (see `launch.up`). Every flag
left out keeps the definition's value."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

app = typer.Typer()


@app.command()
def up(
    stack: Annotated[str, typer.Option(envvar="TANDEM_STACK",
                                       help="Stack definition (TOML); default: the packaged local stack.")] = "",
    port: Annotated[Optional[int], typer.Option(envvar="PORT", help="Router HTTP port (0: a free one).")] = None,
    host: Annotated[Optional[str], typer.Option(envvar="HOST", help="Router host.")] = None,
    engine: Annotated[Optional[str], typer.Option(
        envvar="ENGINE", help="Engine of every worker: sim | vllm (vllm needs vLLM in this Python).")] = None,
    model: Annotated[str, typer.Option(envvar="MODEL", help="Model directory; default: a generated tiny model.")] = "",
    prefill: Annotated[Optional[int], typer.Option(envvar="PREFILL", help="Prefill workers.")] = None,
    decode: Annotated[Optional[int], typer.Option(envvar="DECODE", help="Decode workers.")] = None,
    workers: Annotated[Optional[int], typer.Option(help="Workers that serve whole requests (role both).")] = None,
    routers: Annotated[Optional[int], typer.Option(
        envvar="ROUTERS", help="Router processes on the one router port, sharing their predicted load.")] = None,
    metrics_port: Annotated[Optional[int], typer.Option(envvar="METRICS_PORT")] = None,
    nats_url: Annotated[Optional[str], typer.Option(envvar="TANDEM_NATS_URL",
                                                    help="External NATS; default: embedded.")] = None,
    state_dir: Annotated[str, typer.Option(help="Logs, models and NATS store.")] = ".tandem",
    api_keys_file: Annotated[str, typer.Option(
        envvar="TANDEM_API_KEYS_FILE", help="The router's API key file; default: one made in the state "
                                            "directory, its key in STATE_DIR/api-key.")] = "",
    nats_security: Annotated[bool, typer.Option(
        help="Embedded NATS: a user per service with its own permissions, and TLS (files in STATE_DIR/nats-auth).")
    ] = True,
) -> None:
    """Run the whole local stack: NATS, orchestrator, metrics, workers and router."""
    from launch.up import UpOptions, run_up

    raise typer.Exit(run_up(UpOptions(stack=stack, port=port, host=host, engine=engine or None, model=model,
                                      prefill=prefill, decode=decode, workers=workers, routers=routers,
                                      metrics_port=metrics_port,
                                      nats_url=nats_url or None, state_dir=state_dir,
                                      api_keys_file=api_keys_file, nats_security=nats_security)))
