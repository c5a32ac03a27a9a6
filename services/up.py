"""`tandem up`: the whole local stack in the foreground, with a readable status table.

Ctrl-C or SIGTERM stops every process in order (workers drain first); a failure while
starting stops whatever had started and prints the failing service's log tail.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from services.orchestrator.stack import LocalStack, StackConfig, worker_specs

VLLM_START_TIMEOUT_S = 300.0  # engines start in 15-20 s alone, several on two cores take longer


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


def engine_problem(engine: str) -> str | None:
    """Why this Python cannot run `engine`, or None."""
    if engine == "sim":
        return None
    if engine != "vllm":
        return f"unknown engine {engine!r} (supported: sim, vllm)"
    if importlib.util.find_spec("vllm") is None:
        return ("vLLM is not installed in this Python; `make run` installs it in .venv-vllm "
                "(or run `make install-vllm` and `.venv-vllm/bin/tandem up --engine vllm`)")
    return None


def run_up(*, port: int, host: str, engine: str, model: str, prefill: int, decode: int, workers: int,
           metrics_port: int,
           nats_url: str, state_dir: str) -> int:
    console = Console(stderr=True)
    problem = engine_problem(engine)
    if problem:
        console.print(f"[red]error:[/] {problem}")
        return 2
    if min(prefill, decode, workers) < 0 or decode + workers < 1:
        console.print("[red]error:[/] at least one decode (or --workers) worker is needed; counts cannot be negative")
        return 2
    state = Path(state_dir)
    config = StackConfig(
        model_dir=_model_dir(model, state, console),
        engine=engine,
        workers=worker_specs(prefill, decode, workers, engine, sorted(os.sched_getaffinity(0))),
        router_host=host,
        router_port=port,
        metrics_port=metrics_port,
        nats_url=nats_url,
        log_dir=str(state / "logs"),
        start_timeout_s=VLLM_START_TIMEOUT_S if engine == "vllm" else 60.0,
    )
    stack = LocalStack(config)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the stack the way Ctrl-C does
    try:
        with console.status("starting NATS, orchestrator, metrics, workers and router"):
            stack.start()  # stops what it started if it fails or is interrupted
    except (RuntimeError, TimeoutError) as error:
        console.print(f"[red]Tandem failed to start:[/] {error}")
        return 1
    except KeyboardInterrupt:
        console.print("interrupted while starting; stopped.")
        return 130
    table = Table(title="Tandem is up", show_header=True)
    table.add_column("service")
    table.add_column("pid")
    table.add_column("where")
    table.add_row("nats", str(stack.nats.process.pid) if stack.nats and stack.nats.process else "-", stack.nats_url)
    for name, process in stack.processes.items():
        where = {"router": f"{stack.router_url}/v1", "metrics": f"{stack.metrics_url}/metrics"}.get(name, "")
        table.add_row(name, str(process.pid), where)
    console.print(table)
    console.print(f"OpenAI-compatible API: [bold]{stack.router_url}/v1[/]   logs: {config.log_dir}   Ctrl-C stops")
    print(f"{stack.router_url}/v1", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the ordered stop short
        with console.status("stopping (workers drain first)"):
            stack.stop()
        console.print("Tandem stopped; no process left behind.")
    return 0
