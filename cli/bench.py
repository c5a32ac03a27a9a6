"""`tandem bench ...`: each benchmark parses its own flags (they pass through untouched,
`--help` included) and prints one JSON document on stdout, progress on stderr. The command
exits with the status its benchmark's `main(argv) -> int` returns."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import typer

app = typer.Typer(help="Benchmarks: each prints one JSON document on stdout, progress on stderr.",
                  no_args_is_help=True)
PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}

# (subcommand, the module whose `main` runs it, its help line); imported only when run
BENCHMARKS = (
    ("transfer", "bench.transfer", "KV transfer: Tandem's connector vs plain NIXL, host or GPU memory, and idle CPU"),
    ("index", "bench.index", "KV index: ingest and match vs NVIDIA Dynamo's RadixTree, same events"),
    ("routing", "bench.routing.main",
     "Routing: KV-aware vs round-robin vs random on a local stack of sim workers"),
    ("planner", "bench.planner.main",
     "SLO planner vs static P:D splits on a shifting workload, simulated sim workers"),
    ("serve", "bench.serve.main",
     "Serving: TTFT, ITL, TPOT, throughput against a URL, or topologies side by side"),
    ("calibrate", "bench.calibrate.main",
     "Sim timing profile: time a Llama-shaped model with PyTorch (GPU if any) and fit it"),
    ("soak", "bench.soak.main",
     "Soak: a local stack under a mixed workload for minutes; RSS, errors, leftovers, verdict"),
    ("admission", "bench.admission.main",
     "Priorities and fair shares: the router's admission queue under 2x overload, sim workers"),
    ("router", "bench.router.main",
     "Router cost: requests/s, latency and router CPU per request, Tandem vs Dynamo's frontend"),
)


def _runner(module: str) -> Callable[[typer.Context], None]:
    def run(ctx: typer.Context) -> None:
        raise typer.Exit(importlib.import_module(module).main(list(ctx.args)))

    return run


for _name, _module, _help in BENCHMARKS:
    app.command(_name, help=f"{_help} (--help for options).", context_settings=PASSTHROUGH)(_runner(_module))
