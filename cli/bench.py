"""`tandem bench ...`: each benchmark parses its own flags (they pass through untouched,
`--help` included) and prints one JSON document on stdout, progress on stderr."""

from __future__ import annotations

import typer

app = typer.Typer(help="Benchmarks: each prints one JSON document on stdout, progress on stderr.",
                  no_args_is_help=True)
PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


@app.command("transfer", context_settings=PASSTHROUGH)
def bench_transfer(ctx: typer.Context) -> None:
    """KV transfer: Tandem's connector vs plain NIXL READ, and idle CPU (--help for options)."""
    from bench.transfer import main as bench_main

    bench_main(list(ctx.args))


@app.command("index", context_settings=PASSTHROUGH)
def bench_index(ctx: typer.Context) -> None:
    """KV index: ingest and match vs NVIDIA Dynamo's RadixTree, same events (--help for options)."""
    from bench.index import main as bench_main

    bench_main(list(ctx.args))


@app.command("routing", context_settings=PASSTHROUGH)
def bench_routing(ctx: typer.Context) -> None:
    """Routing: KV-aware vs round-robin vs random on a local stack of sim workers (--help for options)."""
    from bench.routing.main import main as bench_main

    bench_main(list(ctx.args))


@app.command("planner", context_settings=PASSTHROUGH)
def bench_planner(ctx: typer.Context) -> None:
    """SLO planner vs static P:D splits on a shifting workload, simulated sim workers (--help for options)."""
    from bench.planner.main import main as bench_main

    raise typer.Exit(bench_main(list(ctx.args)))


@app.command("serve", context_settings=PASSTHROUGH)
def bench_serve(ctx: typer.Context) -> None:
    """Serving: TTFT, ITL, TPOT, throughput against a URL, or topologies side by side (--help for options)."""
    from bench.serve.main import main as bench_main

    raise typer.Exit(bench_main(list(ctx.args)))


@app.command("calibrate", context_settings=PASSTHROUGH)
def bench_calibrate(ctx: typer.Context) -> None:
    """Sim timing profile: time a Llama-shaped model with PyTorch (GPU if any) and fit it (--help for options)."""
    from bench.calibrate.main import main as bench_main

    raise typer.Exit(bench_main(list(ctx.args)))


@app.command("soak", context_settings=PASSTHROUGH)
def bench_soak(ctx: typer.Context) -> None:
    """Soak: a local stack under a mixed workload for minutes; RSS, errors, leftovers, verdict (--help for options)."""
    from bench.soak.main import main as bench_main

    raise typer.Exit(bench_main(list(ctx.args)))


@app.command("router", context_settings=PASSTHROUGH)
def bench_router(ctx: typer.Context) -> None:
    """Router cost: requests/s, latency and router CPU per request, Tandem vs Dynamo's frontend (--help for options)."""
    from bench.router.main import main as bench_main

    raise typer.Exit(bench_main(list(ctx.args)))
