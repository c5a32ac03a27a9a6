"""`tandem plan`: capacity planning by simulation (flags pass through to `bench.plan.main`,
`--help` included); prints a table, or JSON with --json or --verify."""

from __future__ import annotations

import typer

app = typer.Typer()
PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


@app.command("plan", context_settings=PASSTHROUGH)
def plan(ctx: typer.Context) -> None:
    """Capacity planning: simulate every P:D split within a worker budget against SLOs (--help for options)."""
    from bench.plan.main import main as plan_main

    raise typer.Exit(plan_main(list(ctx.args)))
