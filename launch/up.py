"""`tandem up`: a stack definition run in the foreground as local processes, with a
readable status table.

The definition is `launch/stacks/local.toml` unless `--stack` names another; the flags
override its worker counts, ports, engine, NATS and model (`UpOptions`). A worker that
exits on its own is started again (`launch.supervisor`). Ctrl-C or SIGTERM
stops every process in order (workers drain first); a failure while starting stops
whatever had started and prints the failing service's log tail.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from launch.api_keys import StackKeys, with_stack_keys
from launch.definition import DefinitionError, checked, default_definition_path, load_definition, with_overrides
from launch.plan import StackConfig, plan_stack
from launch.stack import LocalStack
from launch.supervisor import SUPERVISE_POLL_S, WorkerSupervisor
from shared.nats_auth import has_userinfo, redact_url
from shared.schemas import WorkerRole


@dataclass(frozen=True, slots=True)
class UpOptions:
    """`tandem up`'s flags; None keeps the definition's value."""

    stack: str = ""  # definition file; empty: the packaged local stack
    port: int | None = None
    host: str | None = None
    engine: str | None = None
    model: str = ""
    prefill: int | None = None
    decode: int | None = None
    workers: int | None = None  # role both
    routers: int | None = None  # router processes sharing the router's port
    metrics_port: int | None = None
    nats_url: str | None = None
    state_dir: str = ".tandem"
    api_keys_file: str = ""  # empty: a key file of the stack's own (`launch.api_keys`)
    nats_security: bool = True  # the embedded NATS with a user per service and TLS (`launch.secure_nats`)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _model_dir(model: str, state_dir: Path, console: Console) -> str:
    if model:
        if not Path(model, "config.json").exists():
            raise SystemExit(f"error: {model} is not a model directory (no config.json)")
        return model
    from shared.tiny_model import generate_tiny_model

    path = state_dir / "models" / "tiny"
    with console.status("generating the tiny local model"):
        generate_tiny_model(str(path))
    return str(path)


def engine_problems(engines: list[str]) -> list[str]:
    """Why this Python cannot run these engines (empty: it can)."""
    from services.worker.engines import engine_spec
    from shared.config import ConfigError

    problems = []
    for engine in engines:
        try:
            problem = engine_spec(engine).problem()
        except ConfigError as error:
            problem = str(error)
        if problem:
            problems.append(problem)
    return problems


def run_up(options: UpOptions) -> int:
    console = Console(stderr=True)
    counts = _worker_counts(options)
    flag_error = _flag_error(options, counts)
    if flag_error:
        console.print(f"[red]error:[/] {flag_error}")
        return 2
    try:
        config, keys = _stack_config(options, counts, console)
    except DefinitionError as error:
        console.print(f"[red]error:[/] {error}")
        return 2
    stack = LocalStack(config)
    # SIGTERM stops the stack the way Ctrl-C does; SIGINT is set too, since a process started
    # in the background by a script inherits SIGINT ignored, and would never stop on it.
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, _interrupt)
    try:
        with console.status("starting NATS, orchestrator, metrics, workers and router"):
            stack.start()  # stops what it started if it fails or is interrupted
    except (RuntimeError, TimeoutError) as error:
        console.print(f"[red]Tandem failed to start:[/] {error}")
        return 1
    except KeyboardInterrupt:
        console.print("interrupted while starting; stopped.")
        return 130
    _print_entrances(console, stack, config.log_dir, keys)
    _supervise_until_stopped(console, stack)
    return 0


def _worker_counts(options: UpOptions) -> dict[WorkerRole, int]:
    """The worker counts the flags give, per role (a role without its flag is absent)."""
    given = ((WorkerRole.PREFILL, options.prefill), (WorkerRole.DECODE, options.decode),
             (WorkerRole.BOTH, options.workers))
    return {role: count for role, count in given if count is not None}


def _flag_error(options: UpOptions, counts: dict[WorkerRole, int]) -> str:
    """Why the flags alone cannot make a stack (empty: they can)."""
    if any(count < 0 for count in counts.values()):
        return "worker counts cannot be negative"
    if options.routers is not None and options.routers < 1:
        return "at least one router is needed"
    problems = engine_problems([options.engine] if options.engine else [])
    return problems[0] if problems else ""


def _stack_config(options: UpOptions, counts: dict[WorkerRole, int],
                  console: Console) -> tuple[StackConfig, StackKeys]:
    """The stack to start: the definition with the flags' overrides, planned on this machine's
    cores, its model generated if none is given, its NATS secured and its router's keys set.
    Raises `DefinitionError` for a stack that cannot run here."""
    state = Path(options.state_dir)
    definition = with_overrides(load_definition(options.stack or default_definition_path()),
                                engine=options.engine, counts=counts, router_host=options.host,
                                router_port=options.port, metrics_port=options.metrics_port,
                                nats_url=options.nats_url, routers=options.routers)
    checked(definition, options.stack or "tandem up")
    problems = engine_problems(sorted({group.engine for group in definition.workers if group.count}))
    if problems:
        raise DefinitionError(problems[0])
    model_dir = options.model or definition.model_dir
    definition = with_overrides(definition, model_dir=_model_dir(model_dir, state, console))
    config = plan_stack(definition, log_dir=str(state / "logs"), cores=sorted(os.sched_getaffinity(0)))
    if has_userinfo(config.nats_url):
        raise DefinitionError("no user or password in the NATS URL (it would show in process lists): "
                              "give a credentials file in TANDEM_NATS_CREDS_FILE")
    if options.nats_security and not config.nats_url:
        config = msgspec.structs.replace(config, nats_security_dir=str(state / "nats-auth"))
    return with_stack_keys(config, state, options.api_keys_file)


def _print_entrances(console: Console, stack: LocalStack, log_dir: str, keys: StackKeys) -> None:
    """The status table and where to reach the stack; the API's URL alone on stdout, for scripts."""
    console.print(_status_table(stack))
    console.print(f"OpenAI-compatible API: [bold]{stack.router_url}/v1[/]", soft_wrap=True)
    console.print(f"Cluster page:          [bold]{cluster_page_url(stack)}[/]", soft_wrap=True)
    console.print(f"API key (Bearer):      {keys.key_file or f'a key from {keys.keys_file}'}", soft_wrap=True)
    console.print(f"logs: {log_dir}   Ctrl-C stops", soft_wrap=True)
    print(f"{stack.router_url}/v1", flush=True)


def _supervise_until_stopped(console: Console, stack: LocalStack) -> None:
    """Restart workers that exit on their own until Ctrl-C or SIGTERM, then stop the stack in order."""
    try:
        supervisor = WorkerSupervisor(stack, lambda line: console.print(line, soft_wrap=True))
        while True:  # a worker that exits on its own is started again, within bounds
            time.sleep(SUPERVISE_POLL_S)
            supervisor.tick()
    except KeyboardInterrupt:
        pass
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the ordered stop short
        with console.status("stopping (workers drain first)"):
            stack.stop()
        console.print("Tandem stopped; no process left behind.")


def cluster_page_url(stack: LocalStack) -> str:
    """The metrics collector's live cluster page (`tandem status` reads the same view)."""
    return f"{stack.metrics_url}/cluster/page"


def _status_table(stack: LocalStack) -> Table:
    table = Table(title="Tandem is up", show_header=True)
    table.add_column("service")
    table.add_column("pid")
    table.add_column("where")
    secured = " (users, TLS)" if stack.nats_security is not None else ""
    table.add_row("nats", str(stack.nats.process.pid) if stack.nats and stack.nats.process else "-",
                  redact_url(stack.nats_url) + secured)
    for name, process in stack.processes.items():
        where = {"router": f"{stack.router_url}/v1", "metrics": f"{stack.metrics_url}/metrics"}.get(name, "")
        if name in stack.router_instance_urls:  # a replica: the shared address, and its own
            where = f"{stack.router_url}/v1 (alone: {stack.router_instance_urls[name]})"
        table.add_row(name, str(process.pid), where)
    return table
