"""`tandem ctl`: orchestrator commands from the terminal.

`tandem ctl cordon|uncordon|drain|set-role|add|remove WORKER ... --nats-url URL` (and `tandem ctl
upgrade --model-version V`, which prints each step as the orchestrator reports it) sends one
`OrchestratorCommand` to the orchestrator (`orchestrator.commands`, request/reply) and
prints its `CommandOutcome`; `tandem ctl workers` lists the registered workers as a table.
Exit code 0 when the outcome is `ok`, 1 when `refused` or `failed`, 2 when the
orchestrator did not answer.
"""

from __future__ import annotations

import asyncio
import shlex
from typing import TYPE_CHECKING, Annotated

import msgspec
import typer
from rich.console import Console
from rich.table import Table

from cli.options import Namespace, NatsCa, NatsCert, NatsCreds, NatsKey, NatsUrl, bus_config
from shared.codec import encode
from shared.config import WorkerConfig
from shared.config_argv import config_argv
from shared.schemas import WorkerRole
from shared.schemas import orchestrator as commands
from shared.subjects import Subjects

if TYPE_CHECKING:
    from nats.aio.msg import Msg

app = typer.Typer(help="Operate a running cluster through its orchestrator.", no_args_is_help=True)
Timeout = Annotated[float, typer.Option("--timeout", help="Seconds to wait for the orchestrator's answer.")]
Deadline = Annotated[float, typer.Option("--deadline", help="Seconds the worker may take to finish its work.")]
Force = Annotated[bool, typer.Option("--force", help="Even if it leaves too few decode workers.")]
Adapter = Annotated[str, typer.Argument(help="The adapter's name (of the worker's model).")]
_outcomes = msgspec.msgpack.Decoder(commands.CommandOutcome)
_progress = msgspec.msgpack.Decoder(commands.CommandProgress)


@app.callback()
def nats_files(ctx: typer.Context,
               creds_file: NatsCreds = "", ca_file: NatsCa = "", cert_file: NatsCert = "",
               key_file: NatsKey = "") -> None:
    """Operate a running cluster through its orchestrator (on a secured NATS: the operator's files)."""
    ctx.obj = {"creds_file": creds_file, "ca_file": ca_file, "cert_file": cert_file, "key_file": key_file}


async def send(command: commands.OrchestratorCommand, nats_url: str, namespace: str, timeout_s: float,
               files: dict[str, str] | None = None, *, progress: bool = False) -> commands.CommandOutcome:
    """The orchestrator's answer to `command` (raises TimeoutError / connection errors);
    `progress`: printing each `CommandProgress` the orchestrator publishes meanwhile."""
    from shared.bus import connect

    subjects = Subjects(namespace)
    bus = await connect(bus_config(nats_url, namespace, **(files or {})), "tandem-ctl",
                        connect_timeout_s=min(5.0, timeout_s), give_up_after_s=timeout_s)
    try:
        if progress:
            await bus.client.subscribe(subjects.orchestrator_progress, cb=_print_progress)
        reply = await bus.client.request(subjects.orchestrator_commands, encode(command), timeout=timeout_s)
        return _outcomes.decode(reply.data)
    finally:
        await bus.close()


async def _print_progress(msg: Msg) -> None:
    try:
        step = _progress.decode(msg.data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return
    detail = f": {step.detail}" if step.detail else ""
    typer.secho(f"[{step.index}/{step.total}] {step.step} {step.outcome}{detail}",
                fg="green" if step.outcome == "ok" else "red")


def _issue(ctx: typer.Context,
           command: commands.OrchestratorCommand, nats_url: str, namespace: str,
           timeout_s: float, *, progress: bool = False) -> commands.CommandOutcome:
    files = ctx.obj if isinstance(ctx.obj, dict) else {}  # `nats_files`, the group's options
    try:
        return asyncio.run(send(command, nats_url, namespace, timeout_s, files, progress=progress))
    except Exception as error:
        typer.secho(f"no answer from the orchestrator at {nats_url} ({namespace}): {type(error).__name__} {error}",
                    fg="red", err=True)
        raise typer.Exit(2) from None


def _report(outcome: commands.CommandOutcome) -> None:
    color = {"ok": "green", "refused": "yellow", "failed": "red"}[outcome.outcome]
    target = f" {outcome.worker_id}" if outcome.worker_id else ""
    typer.secho(f"{outcome.outcome}{target}: {outcome.reason}".rstrip(": "), fg=color)
    if outcome.workers:
        Console().print(workers_table(outcome.workers))
    if not outcome.ok:
        raise typer.Exit(1)


def workers_table(workers: list[commands.WorkerSummary]) -> Table:
    table = Table(title="workers")
    table.add_column("worker", no_wrap=True)
    for column in ("role", "status", "gen", "model", "version", "engine", "pid", "launched", "adapters"):
        table.add_column(column)
    for summary in workers:
        registration = summary.registration
        table.add_row(registration.worker_id, registration.role.value, registration.status.value,
                      str(registration.generation), registration.model, registration.model_version,
                      registration.engine, str(registration.pid),
                      "yes" if summary.launched else "", " ".join(registration.adapters))
    return table


@app.command()
def workers(ctx: typer.Context,
            nats_url: NatsUrl = "nats://127.0.0.1:4222", namespace: Namespace = "tandem",
            timeout: Timeout = 5.0) -> None:
    """List the registered workers."""
    outcome = _issue(ctx, commands.ListWorkers(), nats_url, namespace, timeout)
    if not outcome.ok:
        _report(outcome)
    Console().print(workers_table(outcome.workers))


def _admin_command(name: str, kind: type[commands.CordonWorker] | type[commands.UncordonWorker], summary: str) -> None:
    def run(ctx: typer.Context,
            worker_id: str, nats_url: NatsUrl = "nats://127.0.0.1:4222", namespace: Namespace = "tandem",
            timeout: Timeout = 15.0) -> None:
        _report(_issue(ctx, kind(worker_id=worker_id), nats_url, namespace, timeout))

    app.command(name, help=summary)(run)


def _leave_command(name: str, kind: type[commands.DrainWorker] | type[commands.RemoveWorker], summary: str) -> None:
    def run(ctx: typer.Context,
            worker_id: str, nats_url: NatsUrl = "nats://127.0.0.1:4222", namespace: Namespace = "tandem",
            deadline: Deadline = 30.0, force: Force = False, timeout: Timeout = 60.0) -> None:
        _report(_issue(ctx, kind(worker_id=worker_id, deadline_s=deadline, force=force), nats_url, namespace,
                       timeout))

    app.command(name, help=summary)(run)


_admin_command("cordon", commands.CordonWorker, "Send the worker no new work; it keeps its in-flight work and stays.")
_admin_command("uncordon", commands.UncordonWorker, "Let a cordoned worker take new work again.")
_leave_command("drain", commands.DrainWorker,
               "Drain the worker: no new work, finish requests and held KV leases, then leave.")


@app.command("set-role")
def set_role(ctx: typer.Context,
             worker_id: str, role: Annotated[WorkerRole, typer.Argument(help="prefill | decode | both")],
             nats_url: NatsUrl = "nats://127.0.0.1:4222", namespace: Namespace = "tandem", force: Force = False,
             timeout: Timeout = 15.0) -> None:
    """Switch a running worker's role, engine and prefix cache kept."""
    command = commands.SetWorkerRole(worker_id=worker_id, role=role, force=force)
    _report(_issue(ctx, command, nats_url, namespace, timeout))


@app.command()
def add(ctx: typer.Context,
        role: Annotated[WorkerRole, typer.Argument(help="prefill | decode | both")],
        worker_id: Annotated[str, typer.Option("--worker-id", help="Empty: the orchestrator names it.")] = "",
        nats_url: NatsUrl = "nats://127.0.0.1:4222", namespace: Namespace = "tandem",
        timeout: Timeout = 120.0) -> None:
    """Start a worker through the orchestrator's launcher."""
    _report(_issue(ctx, commands.AddWorker(role=role, worker_id=worker_id), nats_url, namespace, timeout))


@app.command()
def wake(ctx: typer.Context,
         model: Annotated[str, typer.Argument(help="A scalable model (the orchestrator's --scalable-model).")],
         nats_url: NatsUrl = "nats://127.0.0.1:4222", namespace: Namespace = "tandem",
         timeout: Timeout = 120.0) -> None:
    """Start a scalable model's workers when it has none (one worker, or its prefill and decode
    workers for NAME=DIR@1p1d), as a router holding its requests does."""
    _report(_issue(ctx, commands.WakeModel(model=model), nats_url, namespace, timeout))


_leave_command("remove", commands.RemoveWorker, "Drain a worker and stop its process (if the orchestrator started it).")

adapter_app = typer.Typer(help="Load or unload a worker's LoRA adapters.", no_args_is_help=True)
app.add_typer(adapter_app, name="adapter")


def _adapter_command(name: str, kind: type[commands.LoadWorkerAdapter] | type[commands.UnloadWorkerAdapter],
                     summary: str, timeout_s: float) -> None:
    def run(ctx: typer.Context,
            worker_id: str, adapter: Adapter, nats_url: NatsUrl = "nats://127.0.0.1:4222",
            namespace: Namespace = "tandem", timeout: Timeout = timeout_s) -> None:
        _report(_issue(ctx, kind(worker_id=worker_id, adapter=adapter), nats_url, namespace, timeout))

    adapter_app.command(name, help=summary)(run)


_adapter_command("load", commands.LoadWorkerAdapter,
                 "The worker holds the adapter from now on (routers send it that adapter's requests).", 60.0)
_adapter_command("unload", commands.UnloadWorkerAdapter, "The worker stops holding the adapter.", 15.0)


def _role_settings(items: list[str]) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for item in items:
        role, sep, flags = item.partition("=")
        if not sep or role not in {r.value for r in WorkerRole}:
            raise typer.BadParameter(f"{item!r}: expected ROLE=FLAGS, ROLE one of prefill, decode, both",
                                     param_hint="--role-settings")
        settings.setdefault(role, []).extend(shlex.split(flags))
    return settings


# An upgrade's usual worker flags, written as the worker parses them (`shared.config_argv`)
NEW_MODEL_EXAMPLE = shlex.join(config_argv(WorkerConfig(worker_id="", model_dir="/models/v2"), ("model_dir",)))


@app.command()
def upgrade(ctx: typer.Context,
            model_version: Annotated[str, typer.Option("--model-version", help="The version to upgrade to.")],
            worker_args: Annotated[str, typer.Option("--worker-args",
                                                     help="Further `tandem worker` flags for every new worker, "
                                                          f"e.g. '{NEW_MODEL_EXAMPLE}'.")] = "",
            role_settings: Annotated[list[str], typer.Option(
                "--role-settings", help="ROLE=FLAGS: further flags for new workers of one role (repeatable).")
            ] = [],  # noqa: B006 (typer reads the default)
            model: Annotated[str, typer.Option("--model", help="Empty: the one model served.")] = "",
            nats_url: NatsUrl = "nats://127.0.0.1:4222", namespace: Namespace = "tandem",
            deadline: Deadline = 30.0, timeout: Timeout = 900.0) -> None:
    """Rolling upgrade: replace every worker by a new-version one of its role, a prefill and a
    decode worker at a time (add, wait until active, drain the old pair)."""
    command = commands.UpgradeWorkers(model_version=model_version, worker_args=shlex.split(worker_args),
                             role_args=_role_settings(role_settings), model=model, deadline_s=deadline)
    _report(_issue(ctx, command, nats_url, namespace, timeout, progress=True))
