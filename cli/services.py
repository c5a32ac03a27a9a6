"""The service commands: `tandem nats|router|orchestrator|metrics|worker`. Each builds its
service's typed config once from flags (and `TANDEM_*` environment variables) and runs it.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Optional

import typer

from cli.options import (
    ApiKeysFile,
    Exporter,
    Heartbeat,
    LogLevel,
    MetricsAuth,
    Namespace,
    NatsCa,
    NatsCert,
    NatsCreds,
    NatsKey,
    NatsReplicas,
    NatsUrl,
    OtlpEndpoint,
    Ttl,
    bus_config,
    membership_config,
    run_service,
    setup_logging,
    tracing_config,
)
from shared.schemas import WorkerRole

app = typer.Typer()


@app.command()
def nats(
    port: Annotated[int, typer.Option(help="Port; -1 picks a free one.")] = -1,
    store_dir: Annotated[Optional[str], typer.Option(help="JetStream store directory.")] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    security_dir: Annotated[str, typer.Option(
        help="Secure it: a user per service with its permissions, and TLS; the credentials files, "
             "certificates and server config are made (afresh) in this directory.")] = "",
    worker_id: Annotated[Optional[list[str]], typer.Option(help="A worker to make a user for (repeat).")] = None,
    tls_host: Annotated[Optional[list[str]], typer.Option(
        help="A host name or address clients dial, for the server certificate (repeat).")] = None,
    namespace: Namespace = "tandem",
) -> None:
    """Run the embedded nats-server (JetStream on) in the foreground."""
    import signal

    from shared.nats_security import NatsSecurity
    from shared.nats_server import EmbeddedNats

    security = None
    if security_dir:
        hosts = tuple(tls_host or ()) + ("127.0.0.1", "localhost", "::1")
        security = NatsSecurity.create(security_dir, namespace, worker_id or [], hosts=hosts)
        typer.echo(f"users and certificates in {security_dir} (server config {security.server_config_file})")
    server = EmbeddedNats(store_dir, host=host, port=port, config_file=security and security.server_config_file,
                          tls=security is not None).start()
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
    nats_creds_file: NatsCreds = "",
    nats_ca_file: NatsCa = "",
    nats_cert_file: NatsCert = "",
    nats_key_file: NatsKey = "",
    nats_replicas: NatsReplicas = 1,
    host: Annotated[str, typer.Option(envvar="TANDEM_HOST")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="TANDEM_PORT", help="HTTP port; 0 picks a free one.")] = 8000,
    reuse_port: Annotated[bool, typer.Option(
        help="Share the port with other routers of the cluster (SO_REUSEPORT, Linux).")] = False,
    instance_port: Annotated[Optional[int], typer.Option(
        help="Also listen on this port, this router alone (health checks of one replica); 0 picks one.")] = None,
    model_dir: Annotated[str, typer.Option(envvar="TANDEM_MODEL_DIR", help="Model directory (tokenizer).")] = "",
    served_model_name: Annotated[str, typer.Option()] = "",
    max_tokens_limit: Annotated[int, typer.Option()] = 4096,
    cache_hit_threshold: Annotated[float, typer.Option(
        envvar="TANDEM_CACHE_HIT_THRESHOLD",
        help="Decode-first default for requests that name none: serve only from a worker already holding "
             "this share of the prompt's KV, else answer finish_reason 'cache_threshold'. 0: off.")] = 0.0,
    routing_policy: Annotated[str, typer.Option(
        help="A registered routing policy: kv-aware (cost model), or one for benchmarks "
             "(round-robin, random, pinned).")] = "kv-aware",
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
    prefix_pull: Annotated[bool, typer.Option(
        help="Let a worker pull a cached prompt prefix from another worker instead of computing it "
             "(off: a plain baseline for benchmarks).")] = True,
    transfer_weight: Annotated[float, typer.Option(
        help="Cost model: per prompt token pulled from another worker's cache, in prompt-token equivalents "
             "(`tandem bench calibrate` style figures: transfer time / prefill time per token).")] = 0.1,
    pull_fixed_tokens: Annotated[float, typer.Option(help="Cost model: the fixed cost of one prefix pull.")] = 32.0,
    eviction_weight: Annotated[float, typer.Option(
        help="Cost model: per cached token that a request's new KV would push out of a full cache.")] = 0.5,
    queue_weight: Annotated[float, typer.Option(
        help="Cost model: per prompt token queued for prefill ahead of the request.")] = 0.5,
    decode_weight: Annotated[float, typer.Option(
        help="Cost model: for a worker whose batch is full (running+waiting = max_num_seqs).")] = 1024.0,
    request_overhead_tokens: Annotated[float, typer.Option(
        help="Cost model: a request's work beyond the prompt tokens it computes (its engine steps' fixed "
             "cost), in prompt tokens; transient prefixes are homed to balance each worker's work.")] = 128.0,
    hot_load_factor: Annotated[float, typer.Option(
        help="Replicate a prefix onto another worker once each of its holders carries more than this x "
             "the mean load of the serving workers (0: never).")] = 1.5,
    replica_share_slack: Annotated[float, typer.Option(
        help="... and only while the prefix's share of recent requests is more than its holders can carry, "
             "each (1 + this) / serving workers of the traffic (negative: the load alone decides).")] = 0.2,
    bounded_affinity: Annotated[bool, typer.Option(
        help="A tenant holding most of its prompt on some workers stays on them until its prefix is hot "
             "(off: the per-request cost alone decides).")] = True,
    cold_victims: Annotated[bool, typer.Option(
        help="On full caches, weigh the eviction cost by how recently each worker's least recently used "
             "prefix was routed (off, the default: every full cache weighs the same).")] = False,
    home_slack_tokens: Annotated[float, typer.Option(
        help="A prompt no worker holds half of goes to its prefix's home worker; a new home costs at most "
             "this much more than the cheapest (0: homes off).")] = 256.0,
    sticky_homes: Annotated[bool, typer.Option(
        help="A prefix's home is the worker that served it last, unless busy; new homes balance the recent "
             "traffic homed on each worker (off: rendezvous hashing only).")] = True,
    resident_homes: Annotated[bool, typer.Option(
        help="Where prefixes need more KV than the cluster holds, only the most requested ones that fit "
             "claim KV on their homes: new homes go where their prompts fit, and a worker whose resident "
             "prefixes overflow its KV sheds a minor one (off: every recently used prefix claims KV).")] = True,
    shortlist_workers: Annotated[int, typer.Option(
        help="Past this many workers, cost a request only against its prefix's holders, its home and "
             "workers drawn at random, up to this many (0: every worker).")] = 16,
    max_queue_factor: Annotated[float, typer.Option(
        help="Admission control: answer 429 once every worker has running+waiting >= max_num_seqs x this. "
             "0: off.")] = 4.0,
    tool_call_parser: Annotated[str, typer.Option(
        help="How the model writes tool calls (hermes, llama3_json, mistral): lets chats use tool_choice "
             "auto, with the calls read from the answer. Empty: tool_choice auto is refused.")] = "",
    verify_kv_hashes: Annotated[bool, typer.Option(
        help="Recompute the chain hash of every block workers announce from its token ids, index that one, "
             "and count the blocks whose sent hash differs (tandem_router_kv_hash_mismatch_blocks_total); "
             "slower ingest, for checking a worker's hashing.")] = False,
    api_keys_file: ApiKeysFile = "",
    metrics_auth: MetricsAuth = "open",
    heartbeat_interval: Heartbeat = 0.5,
    ttl: Ttl = 3.0,
    trace_exporter: Exporter = "none",
    otlp_endpoint: OtlpEndpoint = "",
    log_level: LogLevel = "info",
) -> None:
    """Run the router: OpenAI-compatible HTTP API in front of the workers."""
    from services.router.main import run_router
    from services.router.routing import policy_spec
    from shared.config import ConfigError, RouterConfig, RoutingConfig

    setup_logging(log_level)
    if not model_dir:
        raise typer.BadParameter("a model directory is required (its tokenizer is used)", param_hint="--model-dir")
    routing = RoutingConfig(policy=routing_policy, seed=routing_seed,
                            cache_hit_threshold=cache_hit_threshold, local_prefill_tokens=local_prefill_tokens,
                            max_queue_factor=max_queue_factor, pd_transfer=pd_transfer,  # type: ignore[arg-type]
                            prefix_pull=prefix_pull, transfer_weight=transfer_weight,
                            pull_fixed_tokens=pull_fixed_tokens, eviction_weight=eviction_weight,
                            queue_weight=queue_weight, decode_weight=decode_weight,
                            request_overhead_tokens=request_overhead_tokens, hot_load_factor=hot_load_factor,
                            replica_share_slack=replica_share_slack if replica_share_slack >= 0 else None,
                            bounded_affinity=bounded_affinity, cold_victims=cold_victims,
                            home_slack_tokens=home_slack_tokens, sticky_homes=sticky_homes,
                            resident_homes=resident_homes,
                            shortlist_workers=shortlist_workers)
    config = RouterConfig(host=host, port=port, reuse_port=reuse_port, instance_port=instance_port,
                          model_dir=model_dir, served_model_name=served_model_name,
                          max_tokens_limit=max_tokens_limit, routing=routing, verify_kv_hashes=verify_kv_hashes,
                          tool_call_parser=tool_call_parser,
                          bus=bus_config(nats_url, namespace, nats_creds_file, nats_ca_file, nats_cert_file,
                                         nats_key_file, nats_replicas),
                          api_keys_file=api_keys_file, metrics_auth=metrics_auth,  # type: ignore[arg-type]
                          membership=membership_config(heartbeat_interval, ttl),
                          tracing=tracing_config(trace_exporter, otlp_endpoint))
    try:
        config.validate()
        policy_spec(routing_policy)
    except ConfigError as error:
        raise typer.BadParameter(str(error)) from None
    try:
        result = run_router(config)
    except ConfigError as error:  # an unusable API key file, or NATS refused it (credentials, TLS)
        typer.secho(f"error: {error}", fg="red", err=True)
        raise typer.Exit(2) from None
    if asyncio.iscoroutine(result):
        run_service(result)


@app.command()
def orchestrator(
    nats_url: NatsUrl = "nats://127.0.0.1:4222",
    namespace: Namespace = "tandem",
    nats_creds_file: NatsCreds = "",
    nats_ca_file: NatsCa = "",
    nats_cert_file: NatsCert = "",
    nats_key_file: NatsKey = "",
    nats_replicas: NatsReplicas = 1,
    heartbeat_interval: Heartbeat = 0.5,
    ttl: Ttl = 3.0,
    launcher: Annotated[str, typer.Option(help="How `tandem ctl add` starts workers: none | local | docker.")] = "none",
    worker_engine: Annotated[str, typer.Option(help="Engine of the workers it starts.")] = "sim",
    worker_model_dir: Annotated[str, typer.Option(help="Model directory of the workers it starts.")] = "",
    worker_log_dir: Annotated[str, typer.Option(help="Log directory of the workers it starts.")] = ".tandem/logs",
    worker_args: Annotated[str, typer.Option(help="Further `tandem worker` flags for the workers it starts.")] = "",
    docker_host: Annotated[str, typer.Option(help="Docker launcher: the engine's address.")] = \
        "unix:///var/run/docker.sock",
    worker_image: Annotated[str, typer.Option(help="Docker launcher: the workers' image.")] = "",
    worker_network: Annotated[str, typer.Option(help="Docker launcher: the workers' network.")] = "",
    worker_mount: Annotated[list[str], typer.Option(help="Docker launcher: SOURCE:/path[:ro] (repeat).")] = [],  # noqa: B006
    worker_env: Annotated[list[str], typer.Option(help="Docker launcher: NAME=/file/path (repeat).")] = [],  # noqa: B006
    worker_compose: Annotated[bool, typer.Option(
        help="Docker launcher: network and volume names are the compose file's, in the compose project of "
             "the container this orchestrator runs in.")] = False,
    min_serving_workers: Annotated[int, typer.Option(help="Refuse commands leaving fewer active decode workers.")] = 1,
    min_prefill_workers: Annotated[int, typer.Option(help="Refuse commands leaving fewer active prefill workers.")] = 0,
    max_workers: Annotated[int, typer.Option(help="Worker budget for `add` (0: none).")] = 0,
    max_prefill_workers: Annotated[int, typer.Option(help="0: no limit.")] = 0,
    max_serving_workers: Annotated[int, typer.Option(help="Decode/both workers; 0: no limit.")] = 0,
    command_timeout: Annotated[float, typer.Option(help="Seconds a command waits for a worker's answer.")] = 10.0,
    planner: Annotated[bool, typer.Option(help="Run the SLO planner (role switches, add, remove).")] = False,
    planner_dry_run: Annotated[bool, typer.Option(help="Publish the planner's decisions, carry none out.")] = False,
    planner_interval: Annotated[float, typer.Option(help="Seconds between planner ticks.")] = 2.0,
    planner_window: Annotated[float, typer.Option(help="Seconds of records and load the planner reads.")] = 30.0,
    ttft_p90_ms: Annotated[float, typer.Option(help="Planner SLO: TTFT p90 (ms).")] = 2000.0,
    itl_p90_ms: Annotated[float, typer.Option(help="Planner SLO: inter-token latency p90 (ms).")] = 100.0,
    planner_sustain: Annotated[float, typer.Option(help="Seconds a signal holds before the planner acts.")] = 30.0,
    planner_cooldown: Annotated[float, typer.Option(help="Seconds after any planner action before the next.")] = 60.0,
    planner_max_workers: Annotated[int, typer.Option(help="Planner budget: prefill + decode workers.")] = 8,
    trace_exporter: Exporter = "none",
    otlp_endpoint: OtlpEndpoint = "",
    log_level: LogLevel = "info",
) -> None:
    """Run the orchestrator: owns membership, removes workers whose heartbeats stop, and
    carries out `tandem ctl` commands (cordon, drain, set-role, add, remove); with --planner,
    runs the SLO planner, which switches roles, adds and removes workers (see docs/planner.md)."""
    import shlex
    import socket

    from services.orchestrator.main import run_orchestrator
    from shared.config import (
        ConfigError,
        DockerLauncherConfig,
        OrchestratorConfig,
        PlannerLoopConfig,
        WorkerLauncherConfig,
        WorkerLimits,
    )

    setup_logging(log_level)
    config = OrchestratorConfig(bus=bus_config(nats_url, namespace, nats_creds_file, nats_ca_file, nats_cert_file,
                                               nats_key_file, nats_replicas),
                                membership=membership_config(heartbeat_interval, ttl),
                                command_timeout_s=command_timeout,
                                limits=WorkerLimits(min_serving_workers=min_serving_workers,
                                                    min_prefill_workers=min_prefill_workers, max_workers=max_workers,
                                                    max_prefill_workers=max_prefill_workers,
                                                    max_serving_workers=max_serving_workers),
                                launcher=WorkerLauncherConfig(kind=launcher, engine=worker_engine,  # type: ignore[arg-type]
                                                              model_dir=worker_model_dir, log_dir=worker_log_dir,
                                                              worker_args=tuple(shlex.split(worker_args)),
                                                              docker=DockerLauncherConfig(
                                                                  host=docker_host, image=worker_image,
                                                                  network=worker_network, mounts=tuple(worker_mount),
                                                                  env=tuple(worker_env),
                                                                  # a container's host name is its id
                                                                  compose_container=socket.gethostname()
                                                                  if worker_compose else "")),
                                planner=PlannerLoopConfig(enabled=planner, dry_run=planner_dry_run,
                                                          interval_s=planner_interval, window_s=planner_window,
                                                          ttft_p90_ms=ttft_p90_ms, itl_p90_ms=itl_p90_ms,
                                                          sustain_s=planner_sustain,
                                                          global_cooldown_s=planner_cooldown,
                                                          max_workers=planner_max_workers),
                                tracing=tracing_config(trace_exporter, otlp_endpoint))
    if launcher not in ("none", "local", "docker"):
        raise typer.BadParameter("must be none, local or docker", param_hint="--launcher")
    try:
        config.validate()
    except ConfigError as error:
        raise typer.BadParameter(str(error)) from None
    run_service(run_orchestrator(config))


@app.command()
def metrics(
    nats_url: NatsUrl = "nats://127.0.0.1:4222",
    namespace: Namespace = "tandem",
    nats_creds_file: NatsCreds = "",
    nats_ca_file: NatsCa = "",
    nats_cert_file: NatsCert = "",
    nats_key_file: NatsKey = "",
    nats_replicas: NatsReplicas = 1,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="TANDEM_METRICS_PORT", help="HTTP port; 0 picks one.")] = 9100,
    api_keys_file: Annotated[str, typer.Option(
        envvar="TANDEM_METRICS_API_KEYS_FILE",
        help="API key file (`tandem keys`) guarding the cluster page and /cluster (Bearer, or a browser's "
             "login prompt with the key as password); empty: open.")] = "",
    metrics_auth: MetricsAuth = "open",
    log_level: LogLevel = "info",
) -> None:
    """Run the metrics collector: cluster view as Prometheus metrics and JSON."""
    from services.metrics.main import run_metrics
    from shared.config import ConfigError, MetricsConfig

    setup_logging(log_level)
    config = MetricsConfig(host=host, port=port, bus=bus_config(nats_url, namespace, nats_creds_file, nats_ca_file,
                                                                nats_cert_file, nats_key_file, nats_replicas),
                           api_keys_file=api_keys_file, metrics_auth=metrics_auth)  # type: ignore[arg-type]
    try:
        config.validate()
    except ConfigError as error:
        raise typer.BadParameter(str(error)) from None
    run_service(run_metrics(config))


@app.command()
def worker(
    worker_id: Annotated[str, typer.Option(
        envvar="TANDEM_WORKER_ID", help="Unique worker id (with --worker-slots: the slot to claim).")] = "",
    worker_slots: Annotated[str, typer.Option(
        help="Claim a worker slot in this directory (`shared.worker_slots`) and run under its id.")] = "",
    worker_slot_nats_dir: Annotated[str, typer.Option(
        help="With --worker-slots: the NATS files' directory; connect as the slot's own user.")] = "",
    role: Annotated[WorkerRole, typer.Option(help="prefill | decode | both")] = WorkerRole.BOTH,
    engine: Annotated[str, typer.Option(envvar="TANDEM_ENGINE", help="sim | vllm (`tandem engines`).")] = "sim",
    model_dir: Annotated[str, typer.Option(envvar="TANDEM_MODEL_DIR")] = "",
    served_model_name: Annotated[str, typer.Option()] = "",
    model_version: Annotated[str, typer.Option(help="Model version (rolling upgrades): pairs only equal ones.")] = "",
    block_size: Annotated[int, typer.Option()] = 16,
    kv_blocks: Annotated[int, typer.Option()] = 1024,
    max_num_seqs: Annotated[int, typer.Option()] = 64,
    max_num_batched_tokens: Annotated[int, typer.Option()] = 512,
    max_model_len: Annotated[int, typer.Option()] = 2048,
    sim_profile: Annotated[str, typer.Option(
        help="Timing profile (sim): a JSON file or a packaged name (default, h100-llama-8b-shape).")] = "",
    sim_speedup: Annotated[float, typer.Option(help="Run the sim this many times faster.")] = 1.0,
    vllm_kv_cache_gib: Annotated[float, typer.Option(help="vLLM: KV cache size in GiB (host memory on CPU).")] = 1.0,
    vllm_cpu_threads_bind: Annotated[str, typer.Option(
        help="vLLM on CPU: 'auto', 'nobind' or core ids like '0-3'; pin engines to different cores.")] = "auto",
    vllm_block_size: Annotated[int, typer.Option(help="vLLM: KV block size in tokens; 0: the platform's.")] = 0,
    vllm_eager: Annotated[bool, typer.Option(help="vLLM: eager mode (no CUDA graph capture).")] = True,
    vllm_json_whitespace: Annotated[bool, typer.Option(
        help="vLLM: structured JSON output may hold whitespace between tokens.")] = True,
    kv_transfer: Annotated[bool, typer.Option(help="KV data plane (NIXL): P/D hand-off, prefix pull.")] = True,
    kv_lease_ttl: Annotated[float, typer.Option(help="Seconds a holder keeps blocks for a reader.")] = 10.0,
    kv_fault_fail_fraction: Annotated[float, typer.Option(help="Fault injection: blocks reported failed.")] = 0.0,
    kv_fault_corrupt_fraction: Annotated[float, typer.Option(help="Fault injection: blocks corrupted.")] = 0.0,
    kv_fault_fail_transfer: Annotated[bool, typer.Option(help="Fault injection: every transfer fails.")] = False,
    kv_fault_delay: Annotated[float, typer.Option(help="Fault injection: seconds before each transfer.")] = 0.0,
    kv_fault_cut_after: Annotated[Optional[int], typer.Option(help="Fault injection: cut after N blocks.")] = None,
    kv_fault_seed: Annotated[int, typer.Option(help="Fault injection: which blocks are chosen.")] = 0,
    kv_fault_fail_times: Annotated[int, typer.Option(
        help="Fault injection: 0, chosen blocks fail every read; N, their first N reads (transient).")] = 0,
    kv_retry_attempts: Annotated[int, typer.Option(
        help="Reads again of a block that failed to arrive or verify, before it is computed.")] = 1,
    kv_retry_deadline_ms: Annotated[float, typer.Option(
        help="No retry of a failed block starts later than this after the first read.")] = 500.0,
    load_interval: Annotated[float, typer.Option(help="Seconds between two load snapshots.")] = 0.25,
    caller_check_interval: Annotated[float, typer.Option(
        help="Seconds between two checks that a long request's caller (a router) is still there; "
             "a request whose caller is gone is cancelled. 0: never checked.")] = 5.0,
    restarts: Annotated[int, typer.Option(
        help="Set by a launcher that started this worker again: how often it did (registered, "
             "shown by `tandem status`).")] = 0,
    last_exit: Annotated[str, typer.Option(
        help="Set with --restarts: how the worker's previous process ended.")] = "",
    nats_url: NatsUrl = "nats://127.0.0.1:4222",
    namespace: Namespace = "tandem",
    nats_creds_file: NatsCreds = "",
    nats_ca_file: NatsCa = "",
    nats_cert_file: NatsCert = "",
    nats_key_file: NatsKey = "",
    nats_replicas: NatsReplicas = 1,
    heartbeat_interval: Heartbeat = 0.5,
    ttl: Ttl = 3.0,
    trace_exporter: Exporter = "none",
    otlp_endpoint: OtlpEndpoint = "",
    log_level: LogLevel = "info",
) -> None:
    """Run an engine worker that serves one engine on NATS."""
    import msgspec

    from services.worker.engine import ENGINE_FAILED_EXIT, EngineFailed
    from services.worker.engines import engine_names
    from services.worker.main import run_worker
    from shared.config import KvFaultConfig, KvRetryConfig, KvTransferConfig, WorkerConfig, WorkerSlotsConfig

    setup_logging(log_level)
    if not worker_id and not worker_slots:
        raise typer.BadParameter("a worker id is needed (or --worker-slots)", param_hint="--worker-id")
    if engine not in engine_names():
        raise typer.BadParameter(f"must be one of: {', '.join(engine_names())}", param_hint="--engine")
    config = WorkerConfig(worker_id=worker_id, role=role, engine=engine, model_dir=model_dir,  # type: ignore[arg-type]
                          served_model_name=served_model_name, model_version=model_version,
                          block_size=block_size, kv_blocks=kv_blocks,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=max_model_len, sim_profile=sim_profile, sim_speedup=sim_speedup,
                          vllm_kv_cache_gib=vllm_kv_cache_gib, vllm_cpu_threads_bind=vllm_cpu_threads_bind,
                          vllm_block_size=vllm_block_size, vllm_enforce_eager=vllm_eager,
                          vllm_json_any_whitespace=vllm_json_whitespace,
                          kv_transfer=KvTransferConfig(
                              enabled=kv_transfer, lease_ttl_s=kv_lease_ttl,
                              faults=KvFaultConfig(fail_fraction=kv_fault_fail_fraction,
                                                   corrupt_fraction=kv_fault_corrupt_fraction,
                                                   fail_transfer=kv_fault_fail_transfer, delay_s=kv_fault_delay,
                                                   cut_after_blocks=kv_fault_cut_after, seed=kv_fault_seed,
                                                   fail_times=kv_fault_fail_times),
                              retry=KvRetryConfig(attempts=kv_retry_attempts, deadline_ms=kv_retry_deadline_ms)),
                          bus=bus_config(nats_url, namespace, nats_creds_file, nats_ca_file, nats_cert_file,
                                         nats_key_file, nats_replicas),
                          membership=membership_config(heartbeat_interval, ttl), load_interval_s=load_interval,
                          caller_check_interval_s=caller_check_interval, restarts=restarts, last_exit=last_exit,
                          tracing=tracing_config(trace_exporter, otlp_endpoint))
    if worker_slots:  # the id and NATS files: the slot's, claimed when the worker starts
        config = msgspec.structs.replace(config, slots=WorkerSlotsConfig(directory=worker_slots,
                                                                         nats_dir=worker_slot_nats_dir))
    try:
        run_service(run_worker(config))
    except EngineFailed as error:  # the worker left the cluster already; its launcher may restart it
        typer.secho(f"error: {error}", fg="red", err=True)
        raise typer.Exit(ENGINE_FAILED_EXIT) from None


@app.command()
def engines() -> None:
    """List the engines a worker can run, and whether this Python can run each."""
    from services.worker.engines import engine_names, engine_spec

    for name in engine_names():
        spec = engine_spec(name)
        problem = spec.problem()
        typer.echo(f"{name}: {spec.summary}" + (f"\n  not here: {problem}" if problem else ""))
