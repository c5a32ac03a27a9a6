"""The configs several services read: the bus, tracing, membership, the KV data plane, and the
engine worker's (read by the connector too); each service's own config is beside it
(`services/<service>/config.py`).

Each service's `main` builds its config once, from command-line flags (with `TANDEM_*`
environment variables as defaults, read only in the CLI) and passes it down. Nothing
below `main` reads the environment. A field that is a flag declares it (`shared.config_fields`:
its name, help and environment variable); `validate()` fails fast with a clear message.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from shared.config_fields import flag
from shared.nats_auth import has_userinfo
from shared.schemas.membership import WorkerRole
from shared.subjects import Subjects, check_token


class ConfigError(ValueError):
    pass


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def checked_nats_url(nats_url: str) -> str:
    require(not has_userinfo(nats_url),
            "no user or password in the URL (it would show in process lists): use --nats-creds-file")
    return nats_url


# Paths only: the secrets stay in the files (`shared.nats_secrets`, `shared.nats_security`)
class BusConfig(msgspec.Struct, kw_only=True, frozen=True):
    # One URL, or a comma-separated list: the servers of one NATS cluster, any of which
    # will do (the client moves to another when its server goes)
    nats_url: Annotated[str, flag("NATS server URL.", env="TANDEM_NATS_URL", parse=checked_nats_url)] = \
        "nats://127.0.0.1:4222"
    namespace: Annotated[str, flag("Subject namespace (one per cluster).", env="TANDEM_NAMESPACE")] = "tandem"
    # The service's NATS user and password, in a file (`shared.nats_secrets`); empty: none
    creds_file: Annotated[str, flag("File with this service's NATS user and password.", name="--nats-creds-file",
                                    env="TANDEM_NATS_CREDS_FILE")] = ""
    # TLS (`shared.bus`): the CA that signed the server's certificate (set: TLS on, the TLS
    # handshake first, before any credential is sent), and the client's own certificate
    # and key for servers that verify clients
    tls_ca_file: Annotated[str, flag("CA certificate of the NATS server: TLS on.", name="--nats-ca-file",
                                     env="TANDEM_NATS_CA_FILE")] = ""
    tls_cert_file: Annotated[str, flag("Client certificate shown to NATS (TLS).", name="--nats-cert-file",
                                       env="TANDEM_NATS_CERT_FILE")] = ""
    tls_key_file: Annotated[str, flag("Key of the client certificate.", name="--nats-key-file",
                                      env="TANDEM_NATS_KEY_FILE")] = ""
    # Copies JetStream keeps of each bucket the services create: 1 on a single server, 3 on
    # a 3-node cluster (a bucket then outlives any one server)
    replicas: Annotated[int, flag("Copies JetStream keeps of each bucket created (3 on a 3-node cluster; "
                                  "--nats-url then lists its servers, comma-separated).",
                                  name="--nats-replicas", env="TANDEM_NATS_REPLICAS")] = 1

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca_file)

    @property
    def nats_urls(self) -> list[str]:
        return [url.strip() for url in self.nats_url.split(",") if url.strip()]

    def validate(self) -> None:
        require(bool(self.nats_urls), "at least one NATS URL is needed")
        require(1 <= self.replicas <= 5, "bucket replicas must be between 1 and 5 (JetStream's limit)")

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.namespace)


TRACE_EXPORTERS = ("none", "otlp", "console")


def _known_exporter(exporter: str) -> str:
    require(exporter in TRACE_EXPORTERS, "must be none, otlp or console")
    return exporter


class TracingConfig(msgspec.Struct, kw_only=True, frozen=True):
    exporter: Annotated[Literal["none", "otlp", "console"], flag(
        "none | otlp | console", name="--trace-exporter", env="TANDEM_TRACE_EXPORTER",
        parse=_known_exporter)] = "none"
    otlp_endpoint: Annotated[str, flag("OTLP/HTTP traces endpoint.", env="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")] = ""


class MembershipConfig(msgspec.Struct, kw_only=True, frozen=True):
    heartbeat_interval_s: Annotated[float, flag("Seconds between worker heartbeats.",
                                                name="--heartbeat-interval")] = 0.5
    ttl_s: Annotated[float, flag("Seconds without heartbeat before a worker is removed.", name="--ttl")] = 3.0

    @property
    def bucket_ttl_s(self) -> float:
        """Age limit of bucket entries: a floor for when no orchestrator runs (it removes sooner)."""
        return self.ttl_s * 10

    def validate(self) -> None:
        require(self.heartbeat_interval_s > 0, "heartbeat interval must be positive")
        require(self.ttl_s > 2 * self.heartbeat_interval_s,
                "membership TTL must exceed two heartbeat intervals")


class KvFaultConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Fault injection on the KV transport (connector.faults); all off by default.

    - fail_fraction: chosen blocks are reported failed (their landed bytes are garbage);
    - corrupt_fraction: chosen blocks land corrupted but are reported fine (checksums catch them);
    - fail_transfer: every transfer fails; delay_s: every transfer starts late;
    - cut_after_blocks: a transfer breaks after that many blocks (a peer dying mid-way);
    - fail_times: 0, the chosen (failed, corrupted, cut-off) blocks fail every read (permanent);
      n > 0, each fails its first n reads by a reader, then reads fine (transient).
    """

    fail_fraction: Annotated[float, flag("Fault injection: blocks reported failed.",
                                         name="--kv-fault-fail-fraction")] = 0.0
    corrupt_fraction: Annotated[float, flag("Fault injection: blocks corrupted.",
                                            name="--kv-fault-corrupt-fraction")] = 0.0
    fail_transfer: Annotated[bool, flag("Fault injection: every transfer fails.",
                                        name="--kv-fault-fail-transfer")] = False
    delay_s: Annotated[float, flag("Fault injection: seconds before each transfer.", name="--kv-fault-delay")] = 0.0
    cut_after_blocks: Annotated[int | None, flag("Fault injection: cut after N blocks.",
                                                 name="--kv-fault-cut-after")] = None
    seed: Annotated[int, flag("Fault injection: which blocks are chosen.", name="--kv-fault-seed")] = 0
    fail_times: Annotated[int, flag("Fault injection: 0, chosen blocks fail every read; N, their first N reads "
                                    "(transient).", name="--kv-fault-fail-times")] = 0

    @property
    def active(self) -> bool:
        return bool(self.fail_fraction or self.corrupt_fraction or self.fail_transfer or self.delay_s
                    or self.cut_after_blocks is not None)

    def validate(self) -> None:
        for name in ("fail_fraction", "corrupt_fraction"):
            require(0.0 <= getattr(self, name) <= 1.0, f"kv fault {name} must lie in [0, 1]")
        require(self.delay_s >= 0, "kv fault delay must not be negative")
        require(self.fail_times >= 0, "kv fault fail_times must not be negative")


class KvRetryConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Retry before recompute (connector.retry): a block that failed to arrive or to verify is
    read again, from the same holder under the same lease, before it is computed instead.

    - attempts: further reads of the failed blocks (0: compute them at once);
    - deadline_ms: no retry starts later than this after the first read ended, and a retry's
      read is bounded by what is left of it.
    """

    attempts: Annotated[int, flag("Reads again of a block that failed to arrive or verify, before it is computed.",
                                  name="--kv-retry-attempts")] = 1
    deadline_ms: Annotated[float, flag("No retry of a failed block starts later than this after the first read.",
                                       name="--kv-retry-deadline-ms")] = 500.0

    def validate(self) -> None:
        require(self.attempts >= 0, "kv retry attempts must not be negative")
        require(self.deadline_ms >= 0, "kv retry deadline must not be negative")


KvTransportName = Literal["nixl", "memory"]
KV_TRANSPORTS: tuple[KvTransportName, ...] = ("nixl", "memory")


class KvTransferConfig(msgspec.Struct, frozen=True, kw_only=True):
    # a worker without a data plane computes everything itself
    enabled: Annotated[bool, flag("KV data plane (NIXL): P/D hand-off, prefix pull.", name="--kv-transfer")] = True
    # "nixl": NIXL over UCX, between processes and hosts; "memory": copies between workers
    # of one process (no NIXL needed: laptops, CI).
    transport: KvTransportName = "nixl"
    # how long a holder keeps blocks for a reader that never comes back
    lease_ttl_s: Annotated[float, flag("Seconds a holder keeps blocks for a reader.", name="--kv-lease-ttl")] = 10.0
    lease_sweep_interval_s: Annotated[float, flag(  # one timer per worker
        "Seconds between a worker's sweeps for expired KV leases.", name="--kv-lease-sweep-interval")] = 0.1
    transfer_timeout_s: float = 10.0
    control_timeout_s: float = 2.0
    progress_delay_us: int = 10_000  # NIXL progress thread wake-up; never 0 (it would spin a core)
    push_wait_s: float = 30.0  # how long a decode worker waits for a pushing prefill worker
    faults: KvFaultConfig = KvFaultConfig()
    retry: KvRetryConfig = KvRetryConfig()

    def validate(self) -> None:
        require(self.lease_ttl_s > 0 and self.transfer_timeout_s > 0 and self.control_timeout_s > 0,
                "KV transfer timeouts must be positive")
        require(self.transport in KV_TRANSPORTS,
                f"unknown KV transport {self.transport!r} (known: {', '.join(KV_TRANSPORTS)})")
        require(self.progress_delay_us > 0, "progress_delay_us must be positive (0 spins a core)")
        require(self.lease_sweep_interval_s > 0, "the lease sweep interval must be positive")
        self.faults.validate()
        self.retry.validate()


class WorkerSlotsConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Worker slots (`shared.worker_slots`): with `directory` set the worker claims a slot there
    (its `worker_id`, if set, names the one) and runs under the slot's id; with `nats_dir` set
    it connects as the slot's own NATS user, its files in that `shared.nats_security` layout."""

    directory: Annotated[str, flag("Claim a worker slot in this directory (`shared.worker_slots`) and run under "
                                   "its id.", name="--worker-slots")] = ""
    nats_dir: Annotated[str, flag("With --worker-slots: the NATS files' directory; connect as the slot's own user.",
                                  name="--worker-slot-nats-dir")] = ""


class WorkerConfig(msgspec.Struct, kw_only=True, frozen=True):
    """An engine worker's config, whatever its engine (the connector and the launchers read it
    too). Each engine's own options live in its package, named by its `EngineSpec`
    (`services/worker/sim/config.py`, `services/worker/vllm/config.py`); `tandem worker` takes
    both (`services.worker.config.WorkerCommandConfig`)."""

    # empty with slots: the claimed slot's
    worker_id: Annotated[str, flag("Unique worker id (with --worker-slots: the slot to claim).",
                                   env="TANDEM_WORKER_ID", default="", doc="Letters, digits, `-`, `_`.")]
    slots: WorkerSlotsConfig = WorkerSlotsConfig()
    role: Annotated[WorkerRole, flag("prefill | decode | both")] = WorkerRole.BOTH
    # a name in services.worker.engines (checked when the worker builds it)
    engine: Annotated[str, flag("sim | vllm (`tandem engines`).", env="TANDEM_ENGINE")] = "sim"
    model_dir: Annotated[str, flag("Model directory.", env="TANDEM_MODEL_DIR")] = ""
    served_model_name: Annotated[str, flag("The model's name in the API; empty: the model directory's name.")] = ""
    # part of the compatibility hash: workers of two versions never pair
    model_version: Annotated[str, flag("Model version (rolling upgrades): pairs only equal ones.")] = ""
    block_size: Annotated[int, flag("KV block size in tokens.")] = 16
    tensor_parallel: Annotated[int, flag(
        "Tensor-parallel degree: ranks that split the KV heads (vLLM: one rank per device, processes on CPU; the "
        "sim: one KV pool and transport agent per rank).")] = 1
    pipeline_parallel: Annotated[int, flag("Pipeline-parallel degree: stages that split the layers (the sim).")] = 1
    kv_blocks: Annotated[int, flag("KV blocks in the engine's cache.")] = 1024
    kv_host_blocks: Annotated[int, flag(
        "KV blocks in a host-memory tier behind the engine's cache: blocks evicted from the cache stay there (the sim "
        "moves them; vLLM copies every computed block) and are loaded back on a hit. 0: no host tier.")] = 0
    max_num_seqs: Annotated[int, flag("Batching: most requests running at once.")] = 64
    max_num_batched_tokens: Annotated[int, flag("Batching: most tokens in one engine step.")] = 512
    max_model_len: Annotated[int, flag("Longest request (prompt and answer) in tokens.")] = 2048
    max_adapters: Annotated[int, flag("LoRA adapters held at once (slots); 0: serves no adapter.",
                                      doc="A request naming another adapter loads it, evicting the least "
                                          "recently used one.")] = 0
    adapters: Annotated[tuple[str, ...], flag("A LoRA adapter to load at start (repeat).", name="--adapter")] = ()
    adapter_dir: Annotated[str, flag("vLLM: directory of the model's LoRA adapters, one PEFT directory per adapter "
                                     "name (`tandem model lora`).")] = ""
    kv_transfer: KvTransferConfig = KvTransferConfig()
    load_interval_s: Annotated[float, flag("Seconds between two load snapshots.", name="--load-interval")] = 0.25
    kv_event_interval_s: Annotated[float, flag(
        "Seconds between two flushes of the engine's KV events (one batch a flush). Longer: fewer messages for every router to wake up for, a router hears later of what the worker stored.",
        name="--kv-event-interval")] = 0.02
    drain_timeout_s: float = 30.0
    # a router that died leaves no one listening on its inbox: its requests are cancelled
    caller_check_interval_s: Annotated[float, flag(
        "Seconds between two checks that a long request's caller (a router) is still there; a request whose "
        "caller is gone is cancelled. 0: never checked.", name="--caller-check-interval")] = 5.0
    restarts: Annotated[int, flag("Set by a launcher that started this worker again: how often it did (registered, "
                                  "shown by `tandem status`).")] = 0
    last_exit: Annotated[str, flag("Set with --restarts: how the worker's previous process ended.")] = ""
    bus: BusConfig = BusConfig()
    membership: MembershipConfig = MembershipConfig()
    tracing: TracingConfig = TracingConfig()

    def validate(self) -> None:
        check_token(self.worker_id, "worker id")
        require(self.block_size > 0, "block size must be positive")
        require(self.tensor_parallel >= 1 and self.pipeline_parallel >= 1,
                "tensor and pipeline parallel degrees must be at least 1")
        require(self.kv_blocks > 0, "kv_blocks must be positive")
        require(self.kv_host_blocks >= 0, "kv_host_blocks must not be negative")
        require(self.max_num_seqs > 0, "max_num_seqs must be positive")
        require(self.max_num_batched_tokens >= self.block_size,
                "max_num_batched_tokens must be at least one block")
        require(self.max_model_len > 0, "max_model_len must be positive")
        require(0 <= len(self.adapters) <= self.max_adapters,
                "max_adapters must be at least the number of adapters loaded at start")
        require(self.caller_check_interval_s >= 0, "the caller check interval must not be negative")
        require(self.kv_event_interval_s > 0, "the KV event interval must be positive")
        require(self.load_interval_s > 0, "the load interval must be positive")
        self.membership.validate()
        self.kv_transfer.validate()


MetricsAuth = Literal["open", "api-key"]
METRICS_AUTH_HELP = "/metrics: open (default: scrapers need no key) or api-key."


def check_metrics_auth(metrics_auth: str, api_keys_file: str) -> None:
    """The router's and the metrics collector's `metrics_auth`: api-key needs their key file."""
    require(metrics_auth in ("open", "api-key"), "metrics_auth must be open or api-key")
    require(metrics_auth == "open" or bool(api_keys_file), "metrics_auth api-key needs an API key file")
