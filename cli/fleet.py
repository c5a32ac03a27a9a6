"""`tandem worker-fleet`: many simulated workers in one process (`services.worker.fleet`), for
scale tests and for trying a large cluster on one machine."""

from __future__ import annotations

from typing import Annotated

import typer

from cli.config_options import config_options
from cli.options import LogLevel, run_service, setup_logging
from shared.config import BusConfig, ConfigError, KvTransferConfig, MembershipConfig, TracingConfig, WorkerConfig
from shared.schemas import WorkerRole

app = typer.Typer()


@app.command("worker-fleet")
@config_options("bus", BusConfig, exclude=("replicas",))
@config_options("membership", MembershipConfig)
@config_options("tracing", TracingConfig)
def worker_fleet(
    count: Annotated[int, typer.Option(help="Workers in the fleet.")] = 16,
    id_prefix: Annotated[str, typer.Option(help="Worker ids: this prefix and a 4-digit index.")] = "sim-",
    first_index: Annotated[int, typer.Option(help="Index of the first worker.")] = 0,
    connections: Annotated[int, typer.Option(help="NATS connections the workers share.")] = 1,
    start_concurrency: Annotated[int, typer.Option(help="Workers starting or stopping at once.")] = 64,
    role: Annotated[WorkerRole, typer.Option(help="prefill | decode | both (every worker)")] = WorkerRole.BOTH,
    engine: Annotated[str, typer.Option(help="The fleet's engine: sim only.")] = "sim",
    model_dir: Annotated[str, typer.Option(envvar="TANDEM_MODEL_DIR")] = "",
    served_model_name: Annotated[str, typer.Option()] = "",
    block_size: Annotated[int, typer.Option()] = 16,
    kv_blocks: Annotated[int, typer.Option(help="KV blocks per worker.")] = 256,
    sim_kv_dim: Annotated[int, typer.Option(help="Bytes of KV per token and layer / 4 in the sim's pool.")] = 8,
    max_num_seqs: Annotated[int, typer.Option()] = 64,
    max_model_len: Annotated[int, typer.Option()] = 2048,
    sim_profile: Annotated[str, typer.Option(help="Timing profile (a JSON file or a packaged name).")] = "",
    sim_speedup: Annotated[float, typer.Option(help="Run the sim this many times faster.")] = 1.0,
    kv_transfer: Annotated[bool, typer.Option(
        help="KV data plane between the fleet's workers (in-memory transport).")] = True,
    kv_lease_sweep_interval: Annotated[float, typer.Option(
        help="Seconds between each worker's sweeps for expired KV leases (a timer per worker).")] = 1.0,
    load_interval: Annotated[float, typer.Option(help="Seconds between each worker's load snapshots.")] = 1.0,
    kv_event_interval: Annotated[float, typer.Option(help="Seconds between KV event flushes.")] = 0.02,
    *,
    bus: BusConfig,
    membership: MembershipConfig,
    tracing: TracingConfig,
    log_level: LogLevel = "info",
) -> None:
    """Run COUNT simulated workers in one process, each with its own id, registration, KV pool,
    events and subjects, sharing the NATS connections and one heartbeat ticker."""
    from services.worker.config import FleetConfig
    from services.worker.fleet import run_fleet

    setup_logging(log_level)
    worker = WorkerConfig(worker_id="template", role=role, engine=engine, model_dir=model_dir,
                          served_model_name=served_model_name, block_size=block_size, kv_blocks=kv_blocks,
                          sim_kv_dim=sim_kv_dim, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          sim_profile=sim_profile, sim_speedup=sim_speedup,
                          load_interval_s=load_interval, kv_event_interval_s=kv_event_interval,
                          kv_transfer=KvTransferConfig(enabled=kv_transfer, transport="memory",
                                                       lease_sweep_interval_s=kv_lease_sweep_interval),
                          bus=bus, membership=membership, tracing=tracing)
    config = FleetConfig(worker=worker, count=count, id_prefix=id_prefix, first_index=first_index,
                         connections=connections, start_concurrency=start_concurrency)
    if not model_dir:
        raise typer.BadParameter("a model directory is required (its tokenizer is used)", param_hint="--model-dir")
    try:
        config.validate()
    except ConfigError as error:
        raise typer.BadParameter(str(error)) from None
    run_service(run_fleet(config))
