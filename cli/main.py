"""The `tandem` command line: one subcommand per service, plus `up`, `status`, `nats`, `model`,
`bench`, `compose` and `k8s`, each group in its own module (`cli.services`, `cli.up`, `cli.status`,
`cli.model`, `cli.bench`, `cli.compose`, `cli.k8s`).

Flags may default from `TANDEM_*` environment variables; the command line is the only place
that reads them. The local launcher runs services as `python -m cli.main <service> ...`.
"""

from __future__ import annotations

import typer

from cli import bench, compose, ctl, fleet, k8s, keys, model, plan, services, status, up

app = typer.Typer(help="Tandem: disaggregated prefill/decode LLM serving over NATS.", no_args_is_help=True,
                  pretty_exceptions_show_locals=False)
app.registered_commands += services.app.registered_commands + up.app.registered_commands + status.app.registered_commands
app.registered_commands += plan.app.registered_commands + fleet.app.registered_commands
app.add_typer(model.app, name="model")
app.add_typer(bench.app, name="bench")
app.add_typer(compose.app, name="compose")
app.add_typer(k8s.app, name="k8s")
app.add_typer(keys.app, name="keys")
app.add_typer(ctl.app, name="ctl")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
