"""`tandem model ...`: model utilities."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="Model utilities.", no_args_is_help=True)


@app.command("tiny")
def model_tiny(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the model into.")],
    vocab_size: Annotated[int, typer.Option(help="Token ids of its tokenizer: another size is another vocabulary "
                                                 "(a second model behind one router).")] = 2048,
) -> None:
    """Generate a tiny Llama-architecture model (random weights, local BPE tokenizer)."""
    from shared.tiny_model import generate_tiny_model

    try:
        generate_tiny_model(str(out_dir), vocab_size=vocab_size)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--vocab-size") from None
    typer.echo(f"tiny model written to {out_dir}")


@app.command("vision")
def model_vision(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the model into.")],
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
) -> None:
    """Generate a tiny Idefics3 vision-language model (random weights, local BPE tokenizer, image processor)."""
    from shared.vision_model import generate_vision_model

    generate_vision_model(str(out_dir), seed=seed)
    typer.echo(f"vision model written to {out_dir}")


@app.command("random")
def model_random(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the model into.")],
    shape: Annotated[str, typer.Option(help="Model shape: tiny, llama-135m (SmolLM-135M's), llama-0.5b.")] = "tiny",
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
) -> None:
    """Generate a random-weight Llama of a real model's shape (local BPE tokenizer, no download)."""
    from shared.model_shapes import shape_named
    from shared.tiny_model import generate_tiny_model

    try:
        chosen = shape_named(shape)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--shape") from None
    typer.echo(f"writing a {shape} model ({chosen.parameters() / 1e6:.0f}M parameters, float32) to {out_dir}",
               err=True)
    generate_tiny_model(str(out_dir), seed=seed, **chosen.as_arguments())
    typer.echo(f"{shape} model written to {out_dir}")


@app.command("lora")
def model_lora(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the adapter into (its name is the adapter's: "
                                                 "put it under the workers' --adapter-dir).")],
    base: Annotated[Path, typer.Option("--base", help="The generated model it adapts (its model directory).")],
    rank: Annotated[int, typer.Option(help="LoRA rank.")] = 8,
    alpha: Annotated[int, typer.Option(help="LoRA alpha (the update is scaled by alpha / rank).")] = 16,
    target: Annotated[list[str] | None, typer.Option(help="A projection to adapt (repeat): q_proj, k_proj, v_proj, "
                                                         "o_proj.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random weights: another seed, another adapter.")] = 0,
) -> None:
    """Generate a random-weight LoRA adapter (PEFT layout) for a generated model."""
    from shared.lora_adapter import generate_lora_adapter

    if not (base / "config.json").is_file():
        raise typer.BadParameter(f"{base} is not a model directory (no config.json)", param_hint="--base")
    try:
        generate_lora_adapter(str(out_dir), str(base), rank=rank, alpha=alpha, seed=seed,
                              target_modules=tuple(target or ("q_proj", "v_proj")))
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    typer.echo(f"LoRA adapter written to {out_dir}")
