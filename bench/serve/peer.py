"""The peer a vLLM user would run instead of Tandem, for `tandem bench serve --compare`:
"Nxvllm" is N plain vLLM OpenAI servers (vLLM's own `api_server`, what `vllm serve`
runs) behind vllm-router with round-robin routing.

Each server gets what a Tandem vLLM worker of the same comparison gets: the model, one core
(`VLLM_CPU_OMP_THREADS_BIND`, round-robin over the cores, as `launch.plan` gives workers),
the KV cache size, and `VllmEngineOptions`' engine settings (context length, batch
limits, eager mode, seed, prefix caching). vllm-router comes from PyPI (`vllm-router`,
installed in the vLLM venv by `make install-vllm`); its binary is looked up beside the
running interpreter, then on PATH. Like `LocalStack`, every process runs under a
`LocalLauncher` (own session, dies with its parent, log file each) and readiness is asked
of the servers themselves (their `/health`)."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from launch.process import LocalLauncher, ManagedProcess, start_or_undo
from launch.readiness import free_port, wait_http_ok
from services.worker.vllm.options import VllmEngineOptions

HOST = "127.0.0.1"
ROUTER_BINARY = "vllm-router"


@dataclass(frozen=True, slots=True)
class PeerPlan:
    replicas: int
    engine: VllmEngineOptions  # the settings every server gets (cpu_threads_bind: per server below)
    cores: Sequence[int] = ()

    def core_of(self, index: int) -> str:
        return str(sorted(self.cores)[index % len(self.cores)]) if self.cores else "auto"


def server_argv(options: VllmEngineOptions, port: int, python: str = sys.executable) -> list[str]:
    """One plain vLLM OpenAI server with `options`' engine settings."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--host", HOST, "--port", str(port),
            "--model", options.model_dir, "--served-model-name", options.model_name, "--dtype", options.dtype,
            "--seed", str(options.seed), "--max-model-len", str(options.max_model_len),
            "--max-num-seqs", str(options.max_num_seqs),
            "--max-num-batched-tokens", str(options.max_num_batched_tokens),
            "--kv-cache-memory-bytes", str(options.kv_cache_bytes), "--enable-prefix-caching"]
    if options.block_size is not None:
        argv += ["--block-size", str(options.block_size)]
    if options.enforce_eager:
        argv.append("--enforce-eager")
    if not options.json_any_whitespace:
        argv += ["--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}']
    return argv


def router_argv(binary: str, port: int, metrics_port: int, server_urls: Sequence[str]) -> list[str]:
    return [binary, "--host", HOST, "--port", str(port), "--policy", "round_robin",
            "--prometheus-host", HOST, "--prometheus-port", str(metrics_port), "--worker-urls", *server_urls]


def router_binary() -> str:
    """vllm-router's path: beside this interpreter (the vLLM venv), else on PATH."""
    beside = Path(sys.executable).parent / ROUTER_BINARY
    if beside.exists():
        return str(beside)
    found = shutil.which(ROUTER_BINARY)
    if found is None:
        raise RuntimeError(f"{ROUTER_BINARY} is not installed: `make install-vllm` puts it in the vLLM venv "
                           "(PyPI vllm-router); run the benchmark from there")
    return found


class PeerStack:
    """The peer's processes, started and stopped like a `LocalStack`."""

    def __init__(self, plan: PeerPlan, log_dir: str | Path, start_timeout_s: float) -> None:
        self.plan = plan
        self.launcher = LocalLauncher(log_dir)
        self.start_timeout_s = start_timeout_s
        self.router_url = ""

    def start(self) -> None:
        start_or_undo(self._start, self.stop)

    def _start(self) -> None:
        binary = router_binary()
        started = time.monotonic()
        servers: list[tuple[ManagedProcess, str]] = []
        for index in range(self.plan.replicas):
            port = free_port(HOST)
            env = {"VLLM_CPU_OMP_THREADS_BIND": self.plan.core_of(index)}
            process = self.launcher.start_program(f"vllm-{index + 1}", server_argv(self.plan.engine, port), env)
            servers.append((process, f"http://{HOST}:{port}"))
        for process, url in servers:  # they start together; each is waited for in turn
            wait_http_ok(process, f"{url}/health", self._left(started))
        port = free_port(HOST)
        router = self.launcher.start_program(
            "vllm-router", router_argv(binary, port, free_port(HOST), [url for _, url in servers]))
        self.router_url = f"http://{HOST}:{port}"
        wait_http_ok(router, f"{self.router_url}/health", self._left(started))

    def _left(self, started: float) -> float:
        return max(1.0, self.start_timeout_s - (time.monotonic() - started))

    def stop(self) -> None:
        self.launcher.stop_all(order=[["vllm-router"]])
