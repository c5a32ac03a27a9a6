"""`tandem compose render`: the stack definition as a Docker Compose file (`launch.compose`);
`compose/docker-compose.yml` is its output for the packaged local stack."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="Docker Compose: the stack definition as a compose file.", no_args_is_help=True)


@app.command("render")
def render(
    stack: Annotated[str, typer.Option(help="Stack definition (TOML); default: the packaged local stack.")] = "",
    output: Annotated[str, typer.Option("--output", "-o", help="Write here instead of stdout.")] = "",
) -> None:
    """Print the compose file of a stack definition."""
    from launch.compose import render_compose
    from launch.definition import DefinitionError, default_definition_path, load_definition

    try:
        text = render_compose(load_definition(stack or default_definition_path()))
    except DefinitionError as error:
        typer.secho(f"error: {error}", fg="red", err=True)
        raise typer.Exit(2) from None
    if output:
        Path(output).write_text(text)
    else:
        typer.echo(text, nl=False)
