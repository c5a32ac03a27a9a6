"""One typed config per service.

Each service's `main` builds its config once, from command-line flags (with `TANDEM_*`
environment variables as defaults, read only in the CLI) and passes it down. Nothing
below `main` reads the environment. `validate()` fails fast with a clear message.
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

from shared.schemas.membership import WorkerRole
from shared.subjects import Subjects, check_token


class ConfigError(ValueError):
    pass


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


class BusConfig(msgspec.Struct, kw_only=True, frozen=True):
    # One URL, or a comma-separated list: the servers of one NATS cluster, any of which
    # will do (the client moves to another when its server goes)
    nats_url: str = "nats://127.0.0.1:4222"
    namespace: str = "tandem"
    # The service's NATS user and password, in a file (`shared.nats_secrets`); empty: none
    creds_file: str = ""
    # TLS (`shared.bus`): the CA that signed the server's certificate (set: TLS on, the TLS
    # handshake first, before any credential is sent), and the client's own certificate
    # and key for servers that verify clients
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # Copies JetStream keeps of each bucket the services create: 1 on a single server, 3 on
    # a 3-node cluster (a bucket then outlives any one server)
    replicas: int = 1

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca_file)

    @property
    def nats_urls(self) -> list[str]:
        return [url.strip() for url in self.nats_url.split(",") if url.strip()]

    def validate(self) -> None:
        _require(bool(self.nats_urls), "at least one NATS URL is needed")
        _require(1 <= self.replicas <= 5, "bucket replicas must be between 1 and 5 (JetStream's limit)")

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.namespace)


class TracingConfig(msgspec.Struct, kw_only=True, frozen=True):
    exporter: Literal["none", "otlp", "console"] = "none"
    otlp_endpoint: str = ""


class MembershipConfig(msgspec.Struct, kw_only=True, frozen=True):
    heartbeat_interval_s: float = 0.5
    ttl_s: float = 3.0  # a worker silent for this long is removed

    @property
    def bucket_ttl_s(self) -> float:
        """Age limit of bucket entries: a floor for when no orchestrator runs (it removes sooner)."""
        return self.ttl_s * 10

    def validate(self) -> None:
        _require(self.heartbeat_interval_s > 0, "heartbeat interval must be positive")
        _require(self.ttl_s > 2 * self.heartbeat_interval_s,
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

    fail_fraction: float = 0.0
    corrupt_fraction: float = 0.0
    fail_transfer: bool = False
    delay_s: float = 0.0
    cut_after_blocks: int | None = None
    fail_times: int = 0
    seed: int = 0

    @property
    def active(self) -> bool:
        return bool(self.fail_fraction or self.corrupt_fraction or self.fail_transfer or self.delay_s
                    or self.cut_after_blocks is not None)

    def validate(self) -> None:
        for name in ("fail_fraction", "corrupt_fraction"):
            _require(0.0 <= getattr(self, name) <= 1.0, f"kv fault {name} must lie in [0, 1]")
        _require(self.delay_s >= 0, "kv fault delay must not be negative")
        _require(self.fail_times >= 0, "kv fault fail_times must not be negative")


class KvRetryConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Retry before recompute (connector.retry): a block that failed to arrive or to verify is
    read again, from the same holder under the same lease, before it is computed instead.

    - attempts: further reads of the failed blocks (0: compute them at once);
    - deadline_ms: no retry starts later than this after the first read ended, and a retry's
      read is bounded by what is left of it.
    """

    attempts: int = 1
    deadline_ms: float = 500.0

    def validate(self) -> None:
        _require(self.attempts >= 0, "kv retry attempts must not be negative")
        _require(self.deadline_ms >= 0, "kv retry deadline must not be negative")


KvTransportName = Literal["nixl", "memory"]
KV_TRANSPORTS: tuple[KvTransportName, ...] = ("nixl", "memory")


class KvTransferConfig(msgspec.Struct, frozen=True, kw_only=True):
    enabled: bool = True  # a worker without a data plane computes everything itself
    # "nixl": NIXL over UCX, between processes and hosts; "memory": copies between workers
    # of one process (no NIXL needed: laptops, CI).
    transport: KvTransportName = "nixl"
    lease_ttl_s: float = 10.0  # how long a holder keeps blocks for a reader that never comes back
    lease_sweep_interval_s: float = 0.1  # how often a holder ends expired leases (one timer per worker)
    transfer_timeout_s: float = 10.0
    control_timeout_s: float = 2.0
    progress_delay_us: int = 10_000  # NIXL progress thread wake-up; never 0 (it would spin a core)
    push_wait_s: float = 30.0  # how long a decode worker waits for a pushing prefill worker
    faults: KvFaultConfig = KvFaultConfig()
    retry: KvRetryConfig = KvRetryConfig()

    def validate(self) -> None:
        _require(self.lease_ttl_s > 0 and self.transfer_timeout_s > 0 and self.control_timeout_s > 0,
                 "KV transfer timeouts must be positive")
        _require(self.transport in KV_TRANSPORTS,
                 f"unknown KV transport {self.transport!r} (known: {', '.join(KV_TRANSPORTS)})")
        _require(self.progress_delay_us > 0, "progress_delay_us must be positive (0 spins a core)")
        _require(self.lease_sweep_interval_s > 0, "the lease sweep interval must be positive")
        self.faults.validate()
        self.retry.validate()


class WorkerSlotsConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Worker slots (`shared.worker_slots`): with `directory` set the worker claims a slot there
    (its `worker_id`, if set, names the one) and runs under the slot's id; with `nats_dir` set
    it connects as the slot's own NATS user, its files in that `shared.nats_security` layout."""

    directory: str = ""
    nats_dir: str = ""


class WorkerConfig(msgspec.Struct, kw_only=True, frozen=True):
    worker_id: str  # empty with slots: the claimed slot's
    role: WorkerRole = WorkerRole.BOTH
    engine: str = "sim"  # a name in services.worker.engines (checked when the worker builds it)
    model_dir: str = ""
    served_model_name: str = ""  # defaults to the model directory's name
    model_version: str = ""  # part of the compatibility hash: workers of two versions never pair
    block_size: int = 16
    kv_blocks: int = 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    sim_profile: str = ""  # a timing profile file or packaged name; empty: the packaged default
    sim_speedup: float = 1.0
    sim_layers: int = 4
    sim_kv_dim: int = 64
    vllm_kv_cache_gib: float = 1.0
    vllm_cpu_threads_bind: str = "auto"  # "auto", "nobind" or cores like "0-3"; pin engines apart
    vllm_block_size: int = 0  # 0: the platform's choice (128 on CPU)
    vllm_enforce_eager: bool = True  # False lets vLLM capture CUDA graphs on a GPU
    # structured JSON output may hold whitespace between its tokens (vLLM's default); an
    # engine setting in vLLM, not a request's
    vllm_json_any_whitespace: bool = True
    load_interval_s: float = 0.25
    kv_event_interval_s: float = 0.02
    drain_timeout_s: float = 30.0
    # every this often, a request running longer asks its caller's inbox whether anyone still
    # listens (a router that died leaves none): if not, it is cancelled; 0: never asked
    caller_check_interval_s: float = 5.0
    restarts: int = 0  # set by a launcher that restarted this worker, registered for people
    last_exit: str = ""  # how the previous process of this worker ended
    kv_transfer: KvTransferConfig = KvTransferConfig()
    bus: BusConfig = BusConfig()
    membership: MembershipConfig = MembershipConfig()
    tracing: TracingConfig = TracingConfig()
    slots: WorkerSlotsConfig = WorkerSlotsConfig()

    def validate(self) -> None:
        check_token(self.worker_id, "worker id")
        _require(self.block_size > 0, "block size must be positive")
        _require(self.kv_blocks > 0, "kv_blocks must be positive")
        _require(self.max_num_seqs > 0, "max_num_seqs must be positive")
        _require(self.max_num_batched_tokens >= self.block_size,
                 "max_num_batched_tokens must be at least one block")
        _require(self.max_model_len > 0, "max_model_len must be positive")
        _require(self.sim_speedup > 0, "sim speed-up must be positive")
        _require(self.caller_check_interval_s >= 0, "the caller check interval must not be negative")
        _require(self.vllm_block_size >= 0, "the vLLM block size must be positive (or 0: the platform's)")
        self.membership.validate()
        self.kv_transfer.validate()


class FleetConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Many simulated workers in one process (`tandem worker-fleet`, `services.worker.fleet`):
    each is `worker` (its `worker_id` ignored) under the id `id_prefix` + its index, with its
    own registration, KV pool, events and subjects; they share `connections` NATS connections
    and one ticker for their heartbeats, KV event flushes and load snapshots."""

    worker: WorkerConfig  # the template every worker of the fleet is made from
    count: int = 16
    id_prefix: str = "sim-"
    first_index: int = 0
    connections: int = 1  # NATS connections the workers share, round-robin
    start_concurrency: int = 64  # workers starting (or stopping) at once

    def worker_id(self, index: int) -> str:
        return f"{self.id_prefix}{index:04d}"

    def worker_config(self, index: int) -> WorkerConfig:
        return msgspec.structs.replace(self.worker, worker_id=self.worker_id(index))

    def validate(self) -> None:
        _require(self.count > 0, "a fleet needs at least one worker")
        _require(self.first_index >= 0, "the first index must not be negative")
        _require(self.connections > 0, "a fleet needs at least one NATS connection")
        _require(self.start_concurrency > 0, "start concurrency must be positive")
        _require(self.worker.engine == "sim", "a fleet runs simulated workers only (--engine sim)")
        self.worker_config(self.first_index).validate()
        self.worker_config(self.first_index + self.count - 1).validate()


class RoutingConfig(msgspec.Struct, kw_only=True, frozen=True):
    """How the router picks a request's workers (`services.router.routing`): the policy, the
    cost model's weights, admission. Costs are in prompt-token equivalents."""

    # A name in the router's policy registry (`services.router.routing.registry`), checked
    # when the router starts: kv-aware (the cost model below), or a baseline for benchmarks
    # (round-robin, random), which replaces only the choice of worker (pulls and admission
    # still apply)
    policy: str = "kv-aware"
    seed: int = 0  # the random policy's generator
    # Cost model weights (`services.router.routing.cost`), calibratable from an engine's timing
    # profile and measured transfer bandwidth (`services.router.routing.calibration`)
    prefill_weight: float = 1.0  # per prompt token the computing worker must compute
    transfer_weight: float = 0.1  # per prompt token it pulls from another worker's cache instead
    pull_fixed_tokens: float = 32.0  # per prefix pull: the lease round trip and hand-off, in token equivalents
    eviction_weight: float = 0.5  # per cached token that new KV would push out of a full cache
    queue_weight: float = 0.5  # per prompt token queued for prefill ahead of it on that worker
    decode_weight: float = 1024.0  # for a serving/decode worker whose batch is full (running+waiting = max_num_seqs)
    # a request's work beyond the prompt tokens it computes (its engine steps' fixed cost): where
    # transient prefixes are homed, a miss of 1088 tokens then weighs about 6 hits of 64
    request_overhead_tokens: float = 128.0
    # a prefix whose every holder carries more than this x the serving workers' mean load is
    # hot and replicated: a non-holder pulling it pays no eviction cost (0: never)
    hot_load_factor: float = 1.5
    # ... and only while the prefix's share of recent requests is more than its holders can
    # carry, each (1 + this) / serving workers of the traffic (None: the load alone decides)
    replica_share_slack: float | None = 0.2
    # a tenant holding most of its prompt on some workers stays on them until the prefix is hot
    # (False: the plain per-request cost decides, and a queue can push it off its holders)
    bounded_affinity: bool = True
    # on full caches, the eviction cost is weighted by how recently each worker's least
    # recently used prefix was routed (False: every full cache weighs the same). Off by
    # default: with one active tenant per worker, its last use is Poisson noise, and the
    # weighting then lets a burst evict a tenant that is merely between requests
    cold_victims: bool = False
    prefix_pull: bool = True  # False: a worker never pulls a cached prefix from another (a plain baseline)
    # a prompt no worker holds half of goes to its prefix's home worker: a new home costs at most
    # this much more than the cheapest (0: homes off)
    home_slack_tokens: float = 256.0
    # ... and first to the worker that served its prefix last (its learned home) unless that one
    # is busy; a new home balances the recent traffic of the prefixes homed on each worker
    # (False: rendezvous hashing only)
    sticky_homes: bool = True
    # ... and where the live prefixes need more KV than the cluster holds, only the most
    # requested ones that fit (`routing.homes`: resident) claim KV on their homes: a new home
    # for a resident prefix is sought where its prompt fits beside the residents, and a worker
    # whose residents overflow its KV sheds a minor one; the recurring others (transient: they
    # miss wherever they go) are homed so that each worker's recent work is balanced, a miss
    # weighing several hits (False: every live prefix claims KV)
    resident_homes: bool = True
    # past this many workers a request is costed only against its prefix's holders, its home
    # and workers drawn at random, up to this many (`routing.shortlist`; 0: always every worker)
    shortlist_workers: int = 16
    local_prefill_tokens: int = 256  # a decode worker computes a prompt itself when fewer are uncached there
    prefill_busy_tokens: int = 8192  # a prefill worker with this many prompt tokens queued is busy
    cache_hit_threshold: float = 0.0  # decode-first default for requests that name none; 0: off
    max_queue_factor: float = 4.0  # admission: none past running+waiting >= max_num_seqs x this; 0: off
    retry_after_s: int = 1  # the Retry-After of a 429
    speculative_ttl_s: float = 5.0  # how long a routed prompt counts as cached on its worker without events
    # how a disaggregated request's prompt KV reaches its decode worker: "pull" (prefill
    # first, the decode worker reads a lease), or "push" (the decode worker allocates first,
    # the prefill worker writes each layer as it computes); push falls back to pull for a
    # pair whose engines cannot push (`services.router.routing.plan.kv_transfer_mode`)
    pd_transfer: Literal["pull", "push"] = "pull"

    def validate(self) -> None:
        for name in ("prefill_weight", "transfer_weight", "pull_fixed_tokens", "eviction_weight", "queue_weight",
                     "decode_weight", "request_overhead_tokens", "hot_load_factor", "home_slack_tokens"):
            _require(getattr(self, name) >= 0, f"routing {name} must not be negative")
        _require(self.replica_share_slack is None or self.replica_share_slack >= 0,
                 "routing replica_share_slack must not be negative")
        _require(self.local_prefill_tokens >= 0, "local_prefill_tokens must not be negative")
        _require(self.shortlist_workers == 0 or self.shortlist_workers >= 4,
                 "shortlist_workers must be 0 (off) or at least 4")
        _require(self.prefill_busy_tokens > 0, "prefill_busy_tokens must be positive")
        _require(0.0 <= self.cache_hit_threshold <= 1.0, "cache_hit_threshold must lie in [0, 1]")
        _require(self.max_queue_factor == 0 or self.max_queue_factor >= 1,
                 "max_queue_factor must be 0 (off) or at least 1")
        _require(self.retry_after_s >= 1, "retry_after_s must be at least 1")
        _require(self.speculative_ttl_s > 0, "speculative_ttl_s must be positive")
        _require(bool(self.policy), "routing policy must be named")
        _require(self.pd_transfer in ("pull", "push"), "pd_transfer must be pull or push")


MetricsAuth = Literal["open", "api-key"]


def _check_metrics_auth(metrics_auth: str, api_keys_file: str) -> None:
    _require(metrics_auth in ("open", "api-key"), "metrics_auth must be open or api-key")
    _require(metrics_auth == "open" or bool(api_keys_file), "metrics_auth api-key needs an API key file")


# The ways of writing tool calls in an answer the router reads (services.router.tool_parsers).
TOOL_CALL_FORMATS = ("hermes", "llama3_json", "mistral")


class RouterConfig(msgspec.Struct, kw_only=True, frozen=True):
    host: str = "127.0.0.1"
    port: int = 8000
    model_dir: str = ""  # tokenizer (and chat template) come from here
    served_model_name: str = ""
    max_tokens_limit: int = 4096
    default_max_tokens: int = 16
    accept_timeout_s: float = 2.0
    idle_timeout_s: float = 60.0
    worker_wait_s: float = 5.0  # how long a request waits for a worker to appear
    max_attempts: int = 3  # workers one request may be sent to (refused, lost, resumed mid-stream)
    # several routers on one port (SO_REUSEPORT, Linux): the kernel spreads connections over them
    reuse_port: bool = False
    instance_port: int | None = None  # also listen here, this router alone (0: a free port); None: no
    api_keys_file: str = ""  # a key file (`shared.api_keys`) guards /v1/*; empty: the API is open
    metrics_auth: MetricsAuth = "open"  # whether /metrics needs a key too ("api-key")
    verify_kv_hashes: bool = False  # recompute workers' chain hashes from token ids, count mismatches
    tool_call_parser: str = ""  # how the model writes tool calls (TOOL_CALL_FORMATS); empty: no auto tool choice
    routing: RoutingConfig = RoutingConfig()
    bus: BusConfig = BusConfig()
    membership: MembershipConfig = MembershipConfig()
    tracing: TracingConfig = TracingConfig()

    def validate(self) -> None:
        _require(0 <= self.port < 65536, "port must be in [0, 65535]")
        _require(self.instance_port is None or 0 <= self.instance_port < 65536, "instance port must be in [0, 65535]")
        _require(not self.reuse_port or self.port > 0, "routers sharing a port need that port (not 0)")
        _require(self.max_tokens_limit > 0, "max_tokens_limit must be positive")
        _require(self.accept_timeout_s > 0 and self.idle_timeout_s > 0, "timeouts must be positive")
        _require(self.max_attempts >= 1, "max_attempts must be at least 1")
        _require(self.tool_call_parser in ("", *TOOL_CALL_FORMATS),
                 f"tool_call_parser must be one of {', '.join(TOOL_CALL_FORMATS)} (or empty)")
        _check_metrics_auth(self.metrics_auth, self.api_keys_file)
        self.routing.validate()


class WorkerLimits(msgspec.Struct, kw_only=True, frozen=True):
    """What orchestrator commands may not cross; a command that would is refused."""

    min_serving_workers: int = 1  # ACTIVE decode/both workers of a model (drain, remove, set-role, cordon)
    min_prefill_workers: int = 0  # ACTIVE prefill workers of a model (same commands)
    max_workers: int = 0  # registered workers in all (add); 0: no budget
    max_prefill_workers: int = 0  # 0: no limit (add, set-role)
    max_serving_workers: int = 0  # decode/both; 0: no limit (add, set-role)

    def validate(self) -> None:
        _require(min(self.min_serving_workers, self.min_prefill_workers, self.max_workers, self.max_prefill_workers,
                     self.max_serving_workers) >= 0, "worker limits must not be negative")


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DOCKER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class DockerLauncherConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Where and how the Docker launcher runs worker containers: the engine's address, the
    image, the network, the mounts (`SOURCE:TARGET[:ro]`, SOURCE a volume or an absolute
    host path) and the environment (`NAME=/a/file/path`: paths only, a container's
    environment is visible to whoever may inspect it). With `compose_container` (the
    orchestrator's own container), the network and the volumes are the compose file's
    names, looked up in that container's compose project."""

    host: str = "unix:///var/run/docker.sock"
    image: str = ""
    network: str = ""
    mounts: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    compose_container: str = ""
    engine_timeout_s: float = 120.0  # one engine call (creating a container copies the image on vfs)

    def validate(self) -> None:
        _require(self.engine_timeout_s > 0, "the Docker engine timeout must be positive")
        _require(self.host.startswith(("unix://", "tcp://", "ssh://", "npipe://")),
                 f"docker host {self.host!r} must be a unix://, tcp://, ssh:// or npipe:// address")
        _require(bool(self.image), "the docker launcher needs an image (--worker-image)")
        _require(bool(_DOCKER_NAME.fullmatch(self.network)),
                 f"the docker launcher needs a network name (--worker-network), not {self.network!r}")
        for mount in self.mounts:
            parts = mount.split(":")
            _require(len(parts) in (2, 3) and all(parts[:2]) and parts[1].startswith("/")
                     and (len(parts) == 2 or parts[2] in ("ro", "rw"))
                     and (parts[0].startswith("/") or bool(_DOCKER_NAME.fullmatch(parts[0]))),
                     f"mount {mount!r} must be SOURCE:/container/path[:ro|rw] (SOURCE a volume or /host/path)")
        for entry in self.env:
            name, _, value = entry.partition("=")
            _require(bool(_ENV_NAME.fullmatch(name)), f"worker environment {entry!r} must be NAME=/file/path")
            _require(value.startswith("/") and "\n" not in value,
                     f"worker environment {name} must be an absolute file path (never a secret itself)")


class WorkerLauncherConfig(msgspec.Struct, kw_only=True, frozen=True):
    """How the orchestrator starts workers for AddWorker: "none" refuses, "local" runs
    `tandem worker` child processes on this machine, "docker" runs them as containers
    (`docker`: where and how)."""

    kind: Literal["none", "local", "docker"] = "none"
    engine: str = "sim"
    model_dir: str = ""
    log_dir: str = ".tandem/logs"
    worker_args: tuple[str, ...] = ()  # further `tandem worker` flags, given as they are
    start_timeout_s: float = 60.0
    docker: DockerLauncherConfig = DockerLauncherConfig()

    def validate(self) -> None:
        _require(self.kind in ("none", "local", "docker"), f"launcher {self.kind!r} must be none, local or docker")
        _require(self.kind == "none" or bool(self.model_dir), f"the {self.kind} launcher needs a model directory")
        _require(self.start_timeout_s > 0, "the worker start timeout must be positive")
        if self.kind == "docker":
            self.docker.validate()


class PlannerLoopConfig(msgspec.Struct, kw_only=True, frozen=True):
    """The SLO planner inside the orchestrator: every `interval_s` it reads the cluster over
    the last `window_s` and may switch a worker's role, add or remove one (dry run: only
    publishes what it would do)."""

    enabled: bool = False
    dry_run: bool = False
    interval_s: float = 2.0
    window_s: float = 30.0  # request records and load snapshots this far back
    ttft_p90_ms: float = 2000.0
    itl_p90_ms: float = 100.0
    sustain_s: float = 30.0  # a signal held this long before an action
    global_cooldown_s: float = 60.0
    worker_cooldown_s: float = 300.0
    operator_hold_s: float = 600.0  # a worker an operator command touched is left alone this long
    prefill_capacity_tok_s: float = 0.0  # per prefill worker; 0: unknown (the demand term is left out)
    max_workers: int = 8  # the planner's budget: prefill + decode workers in all
    drain_deadline_s: float = 30.0  # a scale-down's drain

    def validate(self) -> None:
        _require(self.interval_s > 0 and self.window_s > 0, "planner interval and window must be positive")
        _require(self.ttft_p90_ms > 0 and self.itl_p90_ms > 0, "planner SLOs must be positive")
        _require(min(self.sustain_s, self.global_cooldown_s, self.worker_cooldown_s, self.operator_hold_s,
                     self.prefill_capacity_tok_s) >= 0, "planner durations must not be negative")
        _require(self.max_workers >= 2 and self.drain_deadline_s > 0, "planner budget needs 2+ workers")


class OrchestratorConfig(msgspec.Struct, kw_only=True, frozen=True):
    sweep_interval_s: float = 0.25
    command_timeout_s: float = 10.0  # how long a command waits for the worker's answer to show
    limits: WorkerLimits = WorkerLimits()
    launcher: WorkerLauncherConfig = WorkerLauncherConfig()
    planner: PlannerLoopConfig = PlannerLoopConfig()
    bus: BusConfig = BusConfig()
    membership: MembershipConfig = MembershipConfig()
    tracing: TracingConfig = TracingConfig()

    def validate(self) -> None:
        _require(self.sweep_interval_s > 0, "sweep interval must be positive")
        _require(self.command_timeout_s > 0, "the command timeout must be positive")
        self.membership.validate()
        self.limits.validate()
        self.launcher.validate()
        self.planner.validate()


class MetricsConfig(msgspec.Struct, kw_only=True, frozen=True):
    host: str = "127.0.0.1"
    port: int = 9100
    api_keys_file: str = ""  # a key file guards the cluster page and its JSON; empty: open
    metrics_auth: MetricsAuth = "open"  # whether /metrics needs a key too ("api-key")
    bus: BusConfig = BusConfig()
    membership: MembershipConfig = MembershipConfig()
    tracing: TracingConfig = TracingConfig()

    def validate(self) -> None:
        _require(0 <= self.port < 65536, "port must be in [0, 65535]")
        _check_metrics_auth(self.metrics_auth, self.api_keys_file)
