"""`tandem worker-fleet`: many simulated workers in one process (`services.worker.fleet`), for
scale tests and for trying a large cluster on one machine. Its worker options are the worker
config's flags (`cli.config_options`), with a fleet's defaults: a smaller KV pool, slower
timers, the in-memory KV transport."""

from __future__ import annotations

from typing import Annotated

import typer

from cli.config_options import config_options
from cli.options import LogLevel, run_service, setup_logging
from services.worker.config import FleetConfig, WorkerCommandConfig
from services.worker.sim.config import SimEngineConfig
from shared.config import ConfigError, KvTransferConfig, WorkerConfig
from shared.config_fields import config_flags, flag_name

app = typer.Typer()

# The template every worker of the fleet is made from (`FleetConfig.worker`, `.sim`): the
# fleet's defaults where they are not a worker's (many workers share one process and its timers)
FLEET_WORKER = WorkerCommandConfig(
    worker=WorkerConfig(worker_id="template", kv_blocks=256, load_interval_s=1.0,
                        kv_transfer=KvTransferConfig(transport="memory", lease_sweep_interval_s=1.0)),
    sim=SimEngineConfig(kv_dim=8))
# The fields a fleet takes options for: every worker gets the same
FLEET_OPTIONS = tuple(f"worker.{path}" for path in (
    "role", "engine", "model_dir", "served_model_name", "block_size", "kv_blocks", "max_num_seqs", "max_model_len",
    "kv_transfer.enabled", "kv_transfer.lease_sweep_interval_s", "load_interval_s", "kv_event_interval_s")) + (
    "sim.kv_dim", "sim.profile", "sim.speedup")
FLEET_EXCLUDED = tuple(path for path in (".".join(field_flag.path) for field_flag in config_flags(WorkerCommandConfig))
                       if path not in FLEET_OPTIONS and path.split(".")[:2] not in (
                           ["worker", "bus"], ["worker", "membership"], ["worker", "tracing"])
                       ) + ("worker.bus.replicas",)


@app.command("worker-fleet")
@config_options("command", WorkerCommandConfig, exclude=FLEET_EXCLUDED, defaults=FLEET_WORKER)
def worker_fleet(
    count: Annotated[int, typer.Option(help="Workers in the fleet.")] = 16,
    id_prefix: Annotated[str, typer.Option(help="Worker ids: this prefix and a 4-digit index.")] = "sim-",
    first_index: Annotated[int, typer.Option(help="Index of the first worker.")] = 0,
    connections: Annotated[int, typer.Option(help="NATS connections the workers share.")] = 1,
    start_concurrency: Annotated[int, typer.Option(help="Workers starting or stopping at once.")] = 64,
    *,
    command: WorkerCommandConfig,
    log_level: LogLevel = "info",
) -> None:
    """Run COUNT simulated workers in one process, each with its own id, registration, KV pool,
    events and subjects, sharing the NATS connections and one heartbeat ticker."""
    from services.worker.fleet import run_fleet

    setup_logging(log_level)
    worker = command.worker
    config = FleetConfig(worker=worker, sim=command.sim, count=count, id_prefix=id_prefix, first_index=first_index,
                         connections=connections, start_concurrency=start_concurrency)
    if not worker.model_dir:
        raise typer.BadParameter("a model directory is required (its tokenizer is used)",
                                 param_hint=flag_name(WorkerConfig, "model_dir"))
    try:
        config.validate()
    except ConfigError as error:
        raise typer.BadParameter(str(error)) from None
    run_service(run_fleet(config))
