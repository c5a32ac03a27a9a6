"""The `tandem` command line: one subcommand per service, plus `up`, `nats` and `model`.

Flags may default from `TANDEM_*` environment variables; this module is the only place
that reads them. Each subcommand builds its service's typed config once and runs it.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated, Optional

import typer

from shared.schemas import WorkerRole

app = typer.Typer(help="Tandem: disaggregated prefill/decode LLM serving over NATS.", no_args_is_help=True,
                  pretty_exceptions_show_locals=False)
model_app = typer.Typer(help="Model utilities.", no_args_is_help=True)
app.add_typer(model_app, name="model")
bench_app = typer.Typer(help="Benchmarks: each prints one JSON document on stdout, progress on stderr.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")
PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}

NatsUrl = Annotated[str, typer.Option("--nats-url", envvar="TANDEM_NATS_URL", help="NATS server URL.")]
Namespace = Annotated[str, typer.Option("--namespace", envvar="TANDEM_NAMESPACE",
                                        help="Subject namespace (one per cluster).")]
Heartbeat = Annotated[float, typer.Option("--heartbeat-interval", help="Seconds between worker heartbeats.")]
Ttl = Annotated[float, typer.Option("--ttl", help="Seconds without heartbeat before a worker is removed.")]
Exporter = Annotated[str, typer.Option("--trace-exporter", envvar="TANDEM_TRACE_EXPORTER",
                                       help="none | otlp | console")]
OtlpEndpoint = Annotated[str, typer.Option("--otlp-endpoint", envvar="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")]
LogLevel = Annotated[str, typer.Option("--log-level", envvar="TANDEM_LOG_LEVEL")]


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _bus(nats_url: str, namespace: str):
    from shared.config import BusConfig

    return BusConfig(nats_url=nats_url, namespace=namespace)


def _membership(heartbeat: float, ttl: float):
    from shared.config import MembershipConfig

    return MembershipConfig(heartbeat_interval_s=heartbeat, ttl_s=ttl)


def _tracing(exporter: str, endpoint: str):
    from shared.config import TracingConfig

    if exporter not in ("none", "otlp", "console"):
        raise typer.BadParameter("must be none, otlp or console", param_hint="--trace-exporter")
    return TracingConfig(exporter=exporter, otlp_endpoint=endpoint)  # type: ignore[arg-type]


def _run(coro) -> None:
    from shared.config import ConfigError

    try:
        asyncio.run(coro)
    except ConfigError as error:
        typer.secho(f"error: {error}", fg="red", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        pass


@app.command()
def nats(
    port: Annotated[int, typer.Option(help="Port; -1 picks a free one.")] = -1,
    store_dir: Annotated[Optional[str], typer.Option(help="JetStream store directory.")] = None,
) -> None:
    """Run the embedded nats-server (JetStream on) in the foreground."""
    import signal

    from shared.nats_server import EmbeddedNats

    server = EmbeddedNats(store_dir, port=port).start()
    typer.echo(f"nats-server listening on {server.url}")
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)  # after the child started: it keeps its mask
    try:
        signal.sigwait(stop_signals)
    finally:
        server.stop()


@app.command()
def router(
    nats_url: NatsUrl = "nats://127.0.0.1:4222",
    namespace: Namespace = "tandem",
    host: Annotated[str, typer.Option(envvar="TANDEM_HOST")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="TANDEM_PORT", help="HTTP port; 0 picks a free one.")] = 8000,
    model_dir: Annotated[str, typer.Option(envvar="TANDEM_MODEL_DIR", help="Model directory (tokenizer).")] = "",
    served_model_name: Annotated[str, typer.Option()] = "",
    max_tokens_limit: Annotated[int, typer.Option()] = 4096,
    cache_hit_threshold: Annotated[float, typer.Option(
        envvar="TANDEM_CACHE_HIT_THRESHOLD",
        help="Decode-first default for requests that name none: serve only from a worker already holding "
             "this share of the prompt's KV, else answer finish_reason 'cache_threshold'. 0: off.")] = 0.0,
    routing_policy: Annotated[str, typer.Option(
        help="kv-aware (cost model), or a baseline for benchmarks: round-robin, random.")] = "kv-aware",
    routing_seed: Annotated[int, typer.Option(help="Seed of the random policy.")] = 0,
    local_prefill_tokens: Annotated[int, typer.Option(
        envvar="TANDEM_LOCAL_PREFILL_TOKENS",
        help="A decode worker computes a prompt itself when fewer tokens than this are uncached there "
             "(0: always disaggregate when a prefill/decode pair exists).")] = 256,
    pd_transfer: Annotated[str, typer.Option(
        envvar="TANDEM_PD_TRANSFER",
        help="How a disaggregated request's prompt KV reaches the decode worker: pull (prefill first, the "
             "decode worker reads it), or push (the decode worker allocates first, the prefill worker writes "
             "each layer as it computes; pairs whose engines cannot push fall back to pull).")] = "pull",
    max_queue_factor: Annotated[float, typer.Option(
        help="Admission control: answer 429 once every worker has running+waiting >= max_num_seqs x this. "
             "0: off.")] = 4.0,
    heartbeat_interval: Heartbeat = 0.5,
    ttl: Ttl = 3.0,
    trace_exporter: Exporter = "none",
    otlp_endpoint: OtlpEndpoint = "",
    log_level: LogLevel = "info",
) -> None:
    """Run the router: OpenAI-compatible HTTP API in front of the workers."""
    from services.router.main import run_router
    from shared.config import ConfigError, RouterConfig, RoutingConfig

    _logging(log_level)
    if not model_dir:
        raise typer.BadParameter("a model directory is required (its tokenizer is used)", param_hint="--model-dir")
    routing = RoutingConfig(policy=routing_policy, seed=routing_seed,  # type: ignore[arg-type]
                            cache_hit_threshold=cache_hit_threshold, local_prefill_tokens=local_prefill_tokens,
                            max_queue_factor=max_queue_factor, pd_transfer=pd_transfer)  # type: ignore[arg-type]
    config = RouterConfig(host=host, port=port, model_dir=model_dir, served_model_name=served_model_name,
                          max_tokens_limit=max_tokens_limit, routing=routing, bus=_bus(nats_url, namespace),
                          membership=_membership(heartbeat_interval, ttl),
                          tracing=_tracing(trace_exporter, otlp_endpoint))
    try:
        config.validate()
    except ConfigError as error:
        raise typer.BadParameter(str(error)) from None
    result = run_router(config)
    if asyncio.iscoroutine(result):
        _run(result)


@app.command()
def orchestrator(
    nats_url: NatsUrl = "nats://127.0.0.1:4222",
    namespace: Namespace = "tandem",
    heartbeat_interval: Heartbeat = 0.5,
    ttl: Ttl = 3.0,
    trace_exporter: Exporter = "none",
    otlp_endpoint: OtlpEndpoint = "",
    log_level: LogLevel = "info",
) -> None:
    """Run the orchestrator: owns membership, removes workers whose heartbeats stop."""
    from services.orchestrator.main import run_orchestrator
    from shared.config import OrchestratorConfig

    _logging(log_level)
    config = OrchestratorConfig(bus=_bus(nats_url, namespace), membership=_membership(heartbeat_interval, ttl),
                                tracing=_tracing(trace_exporter, otlp_endpoint))
    config.validate()
    _run(run_orchestrator(config))


@app.command()
def metrics(
    nats_url: NatsUrl = "nats://127.0.0.1:4222",
    namespace: Namespace = "tandem",
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="TANDEM_METRICS_PORT", help="HTTP port; 0 picks one.")] = 9100,
    log_level: LogLevel = "info",
) -> None:
    """Run the metrics collector: cluster view as Prometheus metrics and JSON."""
    from services.metrics.main import run_metrics
    from shared.config import MetricsConfig

    _logging(log_level)
    config = MetricsConfig(host=host, port=port, bus=_bus(nats_url, namespace))
    config.validate()
    _run(run_metrics(config))


@app.command()
def worker(
    worker_id: Annotated[str, typer.Option(envvar="TANDEM_WORKER_ID", help="Unique worker id.")],
    role: Annotated[WorkerRole, typer.Option(help="prefill | decode | both")] = WorkerRole.BOTH,
    engine: Annotated[str, typer.Option(envvar="TANDEM_ENGINE", help="sim | vllm")] = "sim",
    model_dir: Annotated[str, typer.Option(envvar="TANDEM_MODEL_DIR")] = "",
    served_model_name: Annotated[str, typer.Option()] = "",
    model_version: Annotated[str, typer.Option(help="Model version (rolling upgrades): pairs only equal ones.")] = "",
    block_size: Annotated[int, typer.Option()] = 16,
    kv_blocks: Annotated[int, typer.Option()] = 1024,
    max_num_seqs: Annotated[int, typer.Option()] = 64,
    max_num_batched_tokens: Annotated[int, typer.Option()] = 512,
    max_model_len: Annotated[int, typer.Option()] = 2048,
    sim_profile: Annotated[str, typer.Option(help="Timing profile JSON (sim).")] = "",
    sim_speedup: Annotated[float, typer.Option(help="Run the sim this many times faster.")] = 1.0,
    vllm_kv_cache_gib: Annotated[float, typer.Option(help="vLLM: KV cache size in GiB (host memory on CPU).")] = 1.0,
    vllm_cpu_threads_bind: Annotated[str, typer.Option(
        help="vLLM on CPU: 'auto', 'nobind' or core ids like '0-3'; pin engines to different cores.")] = "auto",
    vllm_block_size: Annotated[int, typer.Option(help="vLLM: KV block size in tokens; 0: the platform's.")] = 0,
    vllm_eager: Annotated[bool, typer.Option(help="vLLM: eager mode (no CUDA graph capture).")] = True,
    kv_transfer: Annotated[bool, typer.Option(help="KV data plane (NIXL): P/D hand-off, prefix pull.")] = True,
    kv_lease_ttl: Annotated[float, typer.Option(help="Seconds a holder keeps blocks for a reader.")] = 10.0,
    kv_fault_fail_fraction: Annotated[float, typer.Option(help="Fault injection: blocks reported failed.")] = 0.0,
    kv_fault_corrupt_fraction: Annotated[float, typer.Option(help="Fault injection: blocks corrupted.")] = 0.0,
    kv_fault_fail_transfer: Annotated[bool, typer.Option(help="Fault injection: every transfer fails.")] = False,
    kv_fault_delay: Annotated[float, typer.Option(help="Fault injection: seconds before each transfer.")] = 0.0,
    kv_fault_cut_after: Annotated[Optional[int], typer.Option(help="Fault injection: cut after N blocks.")] = None,
    kv_fault_seed: Annotated[int, typer.Option(help="Fault injection: which blocks are chosen.")] = 0,
    nats_url: NatsUrl = "nats://127.0.0.1:4222",
    namespace: Namespace = "tandem",
    heartbeat_interval: Heartbeat = 0.5,
    ttl: Ttl = 3.0,
    trace_exporter: Exporter = "none",
    otlp_endpoint: OtlpEndpoint = "",
    log_level: LogLevel = "info",
) -> None:
    """Run an engine worker that serves one engine on NATS."""
    from services.worker.main import run_worker
    from shared.config import KvFaultConfig, KvTransferConfig, WorkerConfig

    _logging(log_level)
    if engine not in ("sim", "vllm"):
        raise typer.BadParameter("must be sim or vllm", param_hint="--engine")
    config = WorkerConfig(worker_id=worker_id, role=role, engine=engine, model_dir=model_dir,  # type: ignore[arg-type]
                          served_model_name=served_model_name, model_version=model_version,
                          block_size=block_size, kv_blocks=kv_blocks,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=max_model_len, sim_profile=sim_profile, sim_speedup=sim_speedup,
                          vllm_kv_cache_gib=vllm_kv_cache_gib, vllm_cpu_threads_bind=vllm_cpu_threads_bind,
                          vllm_block_size=vllm_block_size, vllm_enforce_eager=vllm_eager,
                          kv_transfer=KvTransferConfig(
                              enabled=kv_transfer, lease_ttl_s=kv_lease_ttl,
                              faults=KvFaultConfig(fail_fraction=kv_fault_fail_fraction,
                                                   corrupt_fraction=kv_fault_corrupt_fraction,
                                                   fail_transfer=kv_fault_fail_transfer, delay_s=kv_fault_delay,
                                                   cut_after_blocks=kv_fault_cut_after, seed=kv_fault_seed)),
                          bus=_bus(nats_url, namespace), membership=_membership(heartbeat_interval, ttl),
                          tracing=_tracing(trace_exporter, otlp_endpoint))
    _run(run_worker(config))


@model_app.command("tiny")
def model_tiny(out_dir: Annotated[Path, typer.Argument(help="Directory to write the model into.")]) -> None:
    """Generate a tiny Llama-architecture model (random weights, local BPE tokenizer)."""
    from shared.tiny_model import generate_tiny_model

    generate_tiny_model(str(out_dir))
    typer.echo(f"tiny model written to {out_dir}")


@bench_app.command("transfer", context_settings=PASSTHROUGH)
def bench_transfer(ctx: typer.Context) -> None:
    """KV transfer: Tandem's connector vs plain NIXL READ, and idle CPU (--help for options)."""
    from connector.bench_transfer import main as bench_main

    bench_main(list(ctx.args))


@bench_app.command("index", context_settings=PASSTHROUGH)
def bench_index(ctx: typer.Context) -> None:
    """KV index: ingest and match vs NVIDIA Dynamo's RadixTree, same events (--help for options)."""
    from services.router.bench_index import main as bench_main

    bench_main(list(ctx.args))


@bench_app.command("routing", context_settings=PASSTHROUGH)
def bench_routing(ctx: typer.Context) -> None:
    """Routing: KV-aware vs round-robin vs random on a local stack of sim workers (--help for options)."""
    from services.router.bench_routing import main as bench_main

    bench_main(list(ctx.args))


@bench_app.command("serve", context_settings=PASSTHROUGH)
def bench_serve(ctx: typer.Context) -> None:
    """Serving: TTFT, ITL, TPOT, throughput against a URL, or topologies side by side (--help for options)."""
    from services.bench.serve import main as bench_main

    raise typer.Exit(bench_main(list(ctx.args)))


@app.command()
def up(
    port: Annotated[int, typer.Option(envvar="PORT", help="Router HTTP port.")] = 8000,
    host: Annotated[str, typer.Option(envvar="HOST")] = "127.0.0.1",
    engine: Annotated[str, typer.Option(envvar="ENGINE", help="sim | vllm (needs vLLM in this Python).")] = "sim",
    model: Annotated[str, typer.Option(envvar="MODEL", help="Model directory; default: a generated tiny model.")] = "",
    prefill: Annotated[int, typer.Option(envvar="PREFILL", help="Prefill workers.")] = 1,
    decode: Annotated[int, typer.Option(envvar="DECODE", help="Decode workers.")] = 1,
    workers: Annotated[int, typer.Option(help="Workers that serve whole requests (role both).")] = 0,
    metrics_port: Annotated[int, typer.Option(envvar="METRICS_PORT")] = 9100,
    nats_url: Annotated[str, typer.Option(envvar="TANDEM_NATS_URL", help="External NATS; default: embedded.")] = "",
    state_dir: Annotated[str, typer.Option(help="Logs, models and NATS store.")] = ".tandem",
) -> None:
    """Run the whole local stack: NATS, orchestrator, metrics, workers and router."""
    from services.up import run_up

    raise typer.Exit(run_up(port=port, host=host, engine=engine, model=model, prefill=prefill, decode=decode,
                            workers=workers,
                            metrics_port=metrics_port, nats_url=nats_url, state_dir=state_dir))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
