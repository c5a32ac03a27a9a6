"""`tandem model ...`: model utilities."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="Model utilities.", no_args_is_help=True)


@app.command("tiny")
def model_tiny(out_dir: Annotated[Path, typer.Argument(help="Directory to write the model into.")]) -> None:
    """Generate a tiny Llama-architecture model (random weights, local BPE tokenizer)."""
    from shared.tiny_model import generate_tiny_model

    generate_tiny_model(str(out_dir))
    typer.echo(f"tiny model written to {out_dir}")
