"""Command-line options many benchmarks share, each spelled once: `add_model_dir` puts the
served model's directory on a bench's argparse parser.

Called by every bench parser that takes a model: `bench.admission.main`, `bench.planner.live`,
`bench.router.main`, `bench.router.rate_cost`, `bench.router.fleet_cost`,
`bench.router.replicas`, `bench.routing.main`, `bench.routing.sweep`, `bench.serve.main`,
`bench.serve.multiturn`, `bench.smoke.lengths` and `bench.soak.main`.
"""

from __future__ import annotations

import argparse

TINY_MODEL_HELP = "model directory (default: a generated tiny model)"


def add_model_dir(parser: argparse.ArgumentParser, *, default: str | None = "", required: bool = False,
                  help_text: str = TINY_MODEL_HELP) -> None:
    """`--model-dir` (`args.model_dir`, a string) on `parser`. Its default `""` means: no
    model given, the bench generates a tiny one (`shared.tiny_model.model_dir_or_tiny`);
    a bench that needs a real model says `required=True` and its own `help_text`."""
    parser.add_argument("--model-dir", default=default, required=required, help=help_text)
