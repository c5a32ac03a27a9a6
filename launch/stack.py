"""One local stack running: NATS, orchestrator, metrics collector, workers and router, each
a separate process started by the `LocalLauncher` from a `StackConfig` (`launch.plan`).

`tandem up` runs it for people; the end-to-end tests and the benchmarks run the same code.
Every process starts at once once NATS is up (the services find each other through NATS),
then the stack waits for each to be ready (`launch.readiness`: health endpoints, worker
registrations). Stop order matters: workers drain first (so in-flight requests finish),
then the router, then the control services, then NATS.

With `routers` > 1, that many router processes share the router's port (`--reuse-port`:
the kernel spreads connections over them) and their predicted load (over NATS); each also
listens on a port of its own (`--instance-port`), where the stack checks that every one
of them is ready. The first is named `router`, the others `router-2`, `router-3`, ...
"""

from __future__ import annotations

from contextlib import ExitStack

from launch import argv
from launch.plan import StackConfig, WorkerSpec
from launch.process import LocalLauncher, ManagedProcess, start_or_undo
from launch.readiness import reserve_port, wait_http_ok, wait_registered
from launch.secure_nats import operator_bus, service_env, start_embedded_nats
from shared.nats_security import NatsSecurity
from shared.nats_server import EmbeddedNats

CONTROL_SERVICES = ("router", "metrics", "orchestrator")


def router_names(count: int) -> list[str]:
    return ["router", *(f"router-{number}" for number in range(2, count + 1))]


def _reserved_port(reserved: ExitStack, host: str) -> int:
    return reserved.enter_context(reserve_port(host)).getsockname()[1]


class LocalStack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.launcher = LocalLauncher(config.log_dir)
        self.nats: EmbeddedNats | None = None
        self.nats_security: NatsSecurity | None = None  # a secured embedded NATS's files
        self.nats_url = config.nats_url
        self.router_url = ""
        self.router_instance_urls: dict[str, str] = {}  # router name -> its own address (replicas only)
        self.metrics_url = ""
        self.start_timeout_s = config.resolved_start_timeout_s()

    def start(self) -> None:
        start_or_undo(self._start, self.stop)

    def _start(self) -> None:
        config = self.config
        if not self.nats_url:
            self.nats, self.nats_security = start_embedded_nats(config)
            self.nats_url = self.nats.url
        with ExitStack() as reserved:  # the ports picked here stay held until their services answer
            router_port = config.router_port or _reserved_port(reserved, config.router_host)
            metrics_port = config.metrics_port or _reserved_port(reserved, config.metrics_host)
            self.launcher.start("orchestrator", argv.orchestrator_args(config, self.nats_url),
                                self._env("orchestrator"))
            metrics = self.launcher.start("metrics", argv.metrics_args(config, self.nats_url, metrics_port),
                                          self._env("metrics"))
            for spec in config.workers:
                self.start_worker(spec)
            self.router_url = f"http://{config.router_host}:{router_port}"
            routers = [self.start_router(name, router_port, reserved) for name in router_names(config.routers)]
            self.metrics_url = f"http://{config.metrics_host}:{metrics_port}"
            wait_http_ok(metrics, self.metrics_url + config.metrics_health, self.start_timeout_s)
            for router in routers:
                wait_http_ok(router, self.router_instance_urls.get(router.name, self.router_url)
                             + config.router_health, self.start_timeout_s)
        self.wait_workers_ready([spec.worker_id for spec in config.workers])

    def start_router(self, name: str, port: int, reserved: ExitStack) -> ManagedProcess:
        """One router process on `port`; a replica (more than one router) shares it and also
        listens on a free port of its own, held in `reserved` until the router answers."""
        config = self.config
        instance_port = None
        if config.routers > 1:
            instance_port = _reserved_port(reserved, config.router_host)
            self.router_instance_urls[name] = f"http://{config.router_host}:{instance_port}"
        args = argv.router_args(config, self.nats_url, port, instance_port)
        # the router's NATS user (when secured) is the same for every replica
        return self.launcher.start(name, args, self._env("router"))

    def start_worker(self, spec: WorkerSpec, *, restarts: int = 0, last_exit: str = "") -> ManagedProcess:
        """`spec`'s worker; a restarted one also registers how often it was restarted and
        how its predecessor ended."""
        args = argv.worker_args(self.config, self.nats_url, spec, restarts=restarts, last_exit=last_exit)
        return self.launcher.start(spec.worker_id, args, self._env(spec.worker_id))

    def _env(self, name: str) -> dict[str, str] | None:
        return service_env(self.nats_security, name)

    @property
    def operator_bus(self):
        """The launcher's own NATS connection settings (the operator's, when secured)."""
        return operator_bus(self.nats_security, self.nats_url, self.config.namespace)

    def wait_worker_ready(self, worker_id: str) -> None:
        self.wait_workers_ready([worker_id])

    def wait_workers_ready(self, worker_ids: list[str]) -> None:
        """Until each worker is registered by the process started for it."""
        wait_registered(self.operator_bus, self.config.namespace,
                        {worker_id: self.worker(worker_id) for worker_id in worker_ids}, self.start_timeout_s)

    def worker(self, worker_id: str) -> ManagedProcess:
        return self.launcher.processes[worker_id]

    @property
    def processes(self) -> dict[str, ManagedProcess]:
        return self.launcher.processes

    def stop(self, timeout_s: float = 15.0) -> None:
        routers = router_names(self.config.routers)
        workers = [name for name in self.launcher.processes if name not in (*CONTROL_SERVICES, *routers)]
        self.launcher.stop_all([workers, routers, ["metrics", "orchestrator"]], timeout_s)
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
