"""The whole local stack as one definition: NATS, orchestrator, metrics collector,
workers and router, each a separate process started by the `LocalLauncher`.

`tandem up` runs it for people; the end-to-end tests run exactly the same definition.
Stop order matters: workers drain first (so in-flight requests finish), then the router,
then the control services, then NATS.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

from services.orchestrator.launcher import LocalLauncher, ManagedProcess
from shared.nats_server import EmbeddedNats
from shared.schemas import WorkerRole

LISTENING = r"{service} listening on (http://[\w.\-]+:(\d+))"
VLLM_KV_CACHE_GIB = 1.0  # per engine; with the model and runtime about 2.6 GB of memory each


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    role: WorkerRole = WorkerRole.BOTH
    extra_args: tuple[str, ...] = ()


class StackConfig(msgspec.Struct, frozen=True, kw_only=True):
    model_dir: str
    engine: str = "sim"
    workers: tuple[WorkerSpec, ...] = (WorkerSpec(worker_id="worker-1"), WorkerSpec(worker_id="worker-2"))
    router_host: str = "127.0.0.1"
    router_port: int = 8000
    metrics_port: int = 0
    nats_url: str = ""  # empty: start an embedded nats-server
    namespace: str = "tandem"
    sim_speedup: float = 1.0
    heartbeat_interval_s: float = 0.5
    ttl_s: float = 3.0
    log_dir: str = ".tandem/logs"
    router_args: tuple[str, ...] = ()  # extra `tandem router` flags (routing policy settings)
    start_timeout_s: float = 60.0


def worker_specs(prefill: int, decode: int, both: int, engine: str = "sim", cores: Sequence[int] = (), *,
                 vllm_kv_cache_gib: float = VLLM_KV_CACHE_GIB, extra_args: Sequence[str] = ()) -> tuple[WorkerSpec, ...]:
    """Workers named by role. vLLM engines on CPU are pinned to cores round-robin (two
    engines on one core set would each size their thread pool for all of it)."""
    named = [*((f"prefill-{i + 1}", WorkerRole.PREFILL) for i in range(prefill)),
             *((f"decode-{i + 1}", WorkerRole.DECODE) for i in range(decode)),
             *((f"worker-{i + 1}", WorkerRole.BOTH) for i in range(both))]
    return tuple(WorkerSpec(worker_id=worker_id, role=role,
                            extra_args=(*extra_args, *engine_args(engine, index, cores, vllm_kv_cache_gib)))
                 for index, (worker_id, role) in enumerate(named))


def engine_args(engine: str, index: int, cores: Sequence[int], vllm_kv_cache_gib: float) -> tuple[str, ...]:
    if engine != "vllm" or not cores:
        return ()
    return ("--vllm-cpu-threads-bind", str(sorted(cores)[index % len(cores)]),
            "--vllm-kv-cache-gib", str(vllm_kv_cache_gib))


class LocalStack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.launcher = LocalLauncher(config.log_dir)
        self.nats: EmbeddedNats | None = None
        self.nats_url = config.nats_url
        self.router_url = ""
        self.metrics_url = ""

    def _common(self) -> list[str]:
        return ["--nats-url", self.nats_url, "--namespace", self.config.namespace]

    def _membership(self) -> list[str]:
        return ["--heartbeat-interval", str(self.config.heartbeat_interval_s), "--ttl", str(self.config.ttl_s)]

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        if not self.nats_url:
            self.nats = EmbeddedNats(str(Path(self.config.log_dir) / "nats")).start()
            self.nats_url = self.nats.url
        self.launcher.start("orchestrator", ["orchestrator", *self._common(), *self._membership()])
        self.launcher.start("metrics", ["metrics", *self._common(), "--port", str(self.config.metrics_port)])
        for spec in self.config.workers:
            self.start_worker(spec)
        self.launcher.start("router", ["router", *self._common(), *self._membership(),
                                       "--host", self.config.router_host, "--port", str(self.config.router_port),
                                       "--model-dir", self.config.model_dir, *self.config.router_args])
        timeout = self.config.start_timeout_s
        self.metrics_url = self.launcher.wait_for_line(
            "metrics", LISTENING.format(service="tandem-metrics"), timeout).group(1)
        self.router_url = self.launcher.wait_for_line(
            "router", LISTENING.format(service="tandem-router"), timeout).group(1)
        for spec in self.config.workers:
            self.wait_worker_ready(spec.worker_id)

    def start_worker(self, spec: WorkerSpec) -> ManagedProcess:
        args = ["worker", *self._common(), *self._membership(), "--worker-id", spec.worker_id,
                "--role", spec.role.value, "--engine", self.config.engine, "--model-dir", self.config.model_dir,
                "--sim-speedup", str(self.config.sim_speedup), *spec.extra_args]
        return self.launcher.start(spec.worker_id, args)

    def wait_worker_ready(self, worker_id: str) -> None:
        self.launcher.wait_for_line(worker_id, rf"worker {worker_id} serving", self.config.start_timeout_s)

    def worker(self, worker_id: str) -> ManagedProcess:
        return self.launcher.processes[worker_id]

    @property
    def processes(self) -> dict[str, ManagedProcess]:
        return self.launcher.processes

    def stop(self, timeout_s: float = 15.0) -> None:
        workers = [spec.worker_id for spec in self.config.workers]
        extra = [name for name in self.launcher.processes
                 if name not in {"router", "metrics", "orchestrator", *workers}]
        self.launcher.stop_all([[*workers, *extra], ["router"], ["metrics", "orchestrator"]], timeout_s)
        if self.nats is not None:
            self.nats.stop()
            self.nats = None

    def wait_until(self, condition, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if condition():
                return
            time.sleep(0.05)
        raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
