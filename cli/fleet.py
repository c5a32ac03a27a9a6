"""`tandem worker-fleet`: many simulated workers in one process (`services.worker.fleet`), for
scale tests and for trying a large cluster on one machine. Its worker options are the worker
config's flags (`cli.config_options`), with a fleet's defaults: a smaller KV pool, slower
timers, the in-memory KV transport."""

from __future__ import annotations

from typing import Annotated

import typer

from cli.config_options import config_options
from cli.options import LogLevel, run_service, setup_logging
from shared.config import ConfigError, KvTransferConfig, WorkerConfig
from shared.config_fields import config_flags, flag_name

app = typer.Typer()

# The template every worker of the fleet is made from (`FleetConfig.worker`): the fleet's
# defaults where they are not a worker's (many workers share one process and its timers)
FLEET_WORKER = WorkerConfig(worker_id="template", kv_blocks=256, sim_kv_dim=8, load_interval_s=1.0,
                            kv_transfer=KvTransferConfig(transport="memory", lease_sweep_interval_s=1.0))
# The worker fields a fleet takes options for: every worker gets the same
FLEET_OPTIONS = ("role", "engine", "model_dir", "served_model_name", "block_size", "kv_blocks", "sim_kv_dim",
                 "max_num_seqs", "max_model_len", "sim_profile", "sim_speedup", "kv_transfer.enabled",
                 "kv_transfer.lease_sweep_interval_s", "load_interval_s", "kv_event_interval_s")
FLEET_EXCLUDED = tuple(path for path in (".".join(field_flag.path) for field_flag in config_flags(WorkerConfig))
                       if path not in FLEET_OPTIONS and path.split(".")[0] not in ("bus", "membership", "tracing")
                       ) + ("bus.replicas",)


@app.command("worker-fleet")
@config_options("worker", WorkerConfig, exclude=FLEET_EXCLUDED, defaults=FLEET_WORKER)
def worker_fleet(
    count: Annotated[int, typer.Option(help="Workers in the fleet.")] = 16,
    id_prefix: Annotated[str, typer.Option(help="Worker ids: this prefix and a 4-digit index.")] = "sim-",
    first_index: Annotated[int, typer.Option(help="Index of the first worker.")] = 0,
    connections: Annotated[int, typer.Option(help="NATS connections the workers share.")] = 1,
    start_concurrency: Annotated[int, typer.Option(help="Workers starting or stopping at once.")] = 64,
    *,
    worker: WorkerConfig,
    log_level: LogLevel = "info",
) -> None:
    """Run COUNT simulated workers in one process, each with its own id, registration, KV pool,
    events and subjects, sharing the NATS connections and one heartbeat ticker."""
    from services.worker.config import FleetConfig
    from services.worker.fleet import run_fleet

    setup_logging(log_level)
    config = FleetConfig(worker=worker, count=count, id_prefix=id_prefix, first_index=first_index,
                         connections=connections, start_concurrency=start_concurrency)
    if not worker.model_dir:
        raise typer.BadParameter("a model directory is required (its tokenizer is used)",
                                 param_hint=flag_name(WorkerConfig, "model_dir"))
    try:
        config.validate()
    except ConfigError as error:
        raise typer.BadParameter(str(error)) from None
    run_service(run_fleet(config))
