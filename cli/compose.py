"""`tandem compose render`: the stack definition as a Docker Compose file (`launch.compose`);
`compose/docker-compose.yml` is its output for the packaged local stack."""

from __future__ import annotations

from typing import Annotated

import typer

from cli.options import print_rendered

app = typer.Typer(help="Docker Compose: the stack definition as a compose file.", no_args_is_help=True)


@app.command("render")
def render(
    stack: Annotated[str, typer.Option(help="Stack definition (TOML); default: the packaged local stack.")] = "",
    output: Annotated[str, typer.Option("--output", "-o", help="Write here instead of stdout.")] = "",
    worker_slots: Annotated[int, typer.Option(
        help="Worker slots (a NATS user each; one per running worker) when TANDEM_WORKER_SLOTS is unset.")] = 8,
    docker_launcher: Annotated[bool, typer.Option(
        help="The orchestrator starts workers for `tandem ctl add` as containers: it mounts the Docker "
             "socket, which is root on the host (docs/compose-launcher.md).")] = False,
) -> None:
    """Print the compose file of a stack definition."""
    from launch.compose import render_compose

    if worker_slots < 1:
        raise typer.BadParameter("at least one worker slot is needed", param_hint="--worker-slots")
    print_rendered(stack, output, lambda definition: render_compose(definition, worker_slots=worker_slots,
                                                                    docker_launcher=docker_launcher))


@app.command("secrets")
def secrets(
    directory: Annotated[str, typer.Argument(help="Where the secrets live (the compose stack's volume).")] = "/secrets",
    namespace: Annotated[str, typer.Option(help="The stack's namespace (NATS permissions).")] = "tandem",
    nats_host: Annotated[list[str], typer.Option(help="A host name clients dial NATS at (repeat).")] = ["nats"],
    worker_slots: Annotated[int, typer.Option(help="Worker slots: a worker id and NATS user each.")] = 8,
    slots_dir: Annotated[str, typer.Option(help="Where the workers claim their slots (a volume they share).")] = "",
) -> None:
    """Make the compose stack's API key, NATS users (one per worker slot), TLS and server
    configuration where missing, and the slots (`launch.compose_secrets`); keep those already
    there. Prints paths, never a secret."""
    from launch.compose_secrets import ensure_secrets

    if worker_slots < 1:
        raise typer.BadParameter("at least one worker slot is needed", param_hint="--worker-slots")
    hosts = tuple(dict.fromkeys([*nats_host, "localhost", "127.0.0.1"]))
    made = ensure_secrets(directory, namespace, hosts, worker_slots=worker_slots, slots_dir=slots_dir or None)
    typer.echo(f"API keys: {made.api_keys_file} (the key: {made.api_key_file})")
    typer.echo(f"NATS: {made.nats_dir} ({'made' if made.made_nats else 'kept'})")
    slots = made.worker_slots
    typer.echo(f"worker slots: {len(slots)} ({slots[0]}..{slots[-1]})" + (f" in {slots_dir}" if slots_dir else ""))
