"""Helpers of the compose tests: a Docker engine check, image builds, and one compose
project (`ComposeStack`) driven through `docker-compose` (v1; `docker compose` v2 works the
same way) with a unique project name, free published ports and a full teardown.

Environment: TANDEM_TEST_BASE_IMAGE (the image's BASE_IMAGE; default the locally made
`tandem-base:bookworm` when the engine has it, else `python:3.11-slim`), TANDEM_TEST_IMAGE
(the tag the Tandem image is built under; default `tandem-test:latest`), CI=true (a
missing engine fails instead of skipping).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose" / "docker-compose.yml"
LOCAL_BASE_IMAGE = "tandem-base:bookworm"
TEST_IMAGE = os.environ.get("TANDEM_TEST_IMAGE", "tandem-test:latest")
TEST_VLLM_CPU_IMAGE = "tandem-test-vllm-cpu:latest"


def compose_command() -> list[str]:
    """`docker-compose` (v1) if installed, else `docker compose` (v2)."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return ["docker", "compose"]


def engine_problem() -> str:
    """Why no Docker engine can run the compose tests here ('' when one can)."""
    if shutil.which("docker") is None:
        return "the docker command is not installed"
    try:
        info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True,
                              text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer in 30 s"
    if info.returncode != 0:
        return f"no Docker engine answers: {info.stderr.strip()[:200]}"
    version = subprocess.run([*compose_command(), "version"], capture_output=True, text=True)
    if version.returncode != 0:
        return "neither docker-compose nor the docker compose plugin is installed"
    return ""


def base_image() -> str:
    chosen = os.environ.get("TANDEM_TEST_BASE_IMAGE", "")
    if chosen:
        return chosen
    local = subprocess.run(["docker", "image", "inspect", LOCAL_BASE_IMAGE], capture_output=True)
    return LOCAL_BASE_IMAGE if local.returncode == 0 else "python:3.11-slim"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(args: list[str], *, env: dict[str, str] | None = None, timeout_s: float = 600,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout_s, cwd=ROOT)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {result.returncode}:\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-3000:]}")
    return result


def prepare_context(torch: bool = False) -> None:
    run([str(ROOT / "compose" / "prepare-context"), *(["--torch"] if torch else [])])


def http_json(url: str, timeout_s: float = 5.0) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return reply.status, json.loads(reply.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")
    except (OSError, ValueError):
        return 0, None


def http_text(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return reply.read().decode()


def metric_total(exposition: str, name: str) -> float:
    """The sum of a metric's samples over all label sets in a Prometheus text exposition."""
    total = 0.0
    for line in exposition.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class ComposeStack:
    """One compose project of compose/docker-compose.yml, under a unique name."""

    profiles: tuple[str, ...] = ()  # empty: compose/.env's default (sim)
    images: dict[str, str] = field(default_factory=dict)  # TANDEM_* image variables
    project: str = field(default_factory=lambda: "tandemtest" + uuid.uuid4().hex[:10])
    router_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)

    @property
    def env(self) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if key != "COMPOSE_PROFILES"}
        # docker-compose v1 gives the engine 60 s per call by default: too short for removing
        # containers on a busy machine with the vfs storage driver.
        env.setdefault("COMPOSE_HTTP_TIMEOUT", "600")
        env.update(PORT=str(self.router_port), METRICS_PORT=str(self.metrics_port), **self.images)
        return env

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    def compose(self, *args: str, timeout_s: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        profiles = [flag for profile in self.profiles for flag in ("--profile", profile)]
        return run([*compose_command(), "-p", self.project, "-f", str(COMPOSE_FILE), *profiles, *args],
                   env=self.env, timeout_s=timeout_s, check=check)

    def exec(self, service: str, *command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`command` in the service's (first) running container."""
        return self.compose("exec", "-T", service, *command, timeout_s=120, check=check)

    def api_key(self) -> str:
        """The router's API key, made by the secrets service in its volume (read through Docker)."""
        return self.exec("router", "cat", "/secrets/api-key").stdout.strip()

    def containers(self, service: str) -> list[str]:
        """Ids of the service's running containers."""
        return self.compose("ps", "-q", service).stdout.split()

    def up(self, ready_timeout_s: float = 180) -> None:
        """Start the stack's containers (their images built already), then `wait_ready`."""
        self.compose("up", "-d", "--no-build")
        self.wait_ready(timeout_s=ready_timeout_s)

    def wait_ready(self, serving_workers: int = 1, timeout_s: float = 180) -> dict:
        """Until the router's /ready lists at least `serving_workers` workers."""
        deadline = time.monotonic() + timeout_s
        body: object = None
        while time.monotonic() < deadline:
            status, body = http_json(self.router_url + "/ready")
            if status == 200 and isinstance(body, dict) and len(body["serving_workers"]) >= serving_workers:
                return body
            time.sleep(0.5)
        raise AssertionError(f"the router never listed {serving_workers} serving workers: {body}\n"
                             f"{self.logs()}")

    def wait_router_workers(self, count: int, timeout_s: float = 60) -> list[str]:
        """Until the router knows `count` workers of any role (/ready lists serving ones only: a
        prefill worker may register after the stack is ready)."""
        deadline = time.monotonic() + timeout_s
        body: object = None
        while time.monotonic() < deadline:
            status, body = http_json(self.router_url + "/health")
            if status == 200 and isinstance(body, dict) and body["worker_count"] >= count:
                return body["workers"]
            time.sleep(0.5)
        raise AssertionError(f"the router never knew {count} workers: {body}\n{self.logs()}")

    def cluster(self) -> dict:
        status, body = http_json(self.metrics_url + "/cluster")
        assert status == 200 and isinstance(body, dict), f"metrics collector: {status} {body}"
        return body

    def workers(self, role: str) -> dict[str, dict]:
        return {worker["worker_id"]: worker for worker in self.cluster()["workers"] if worker["role"] == role}

    def wait_workers(self, role: str, count: int, timeout_s: float = 60) -> dict[str, dict]:
        """Until the metrics collector knows `count` workers of `role`."""
        deadline = time.monotonic() + timeout_s
        while len(workers := self.workers(role)) < count:
            assert time.monotonic() < deadline, f"the metrics collector never saw {count} {role} workers: {workers}"
            time.sleep(0.5)
        return workers

    def wait_generated(self, role: str, worker_id: str, timeout_s: float) -> None:
        """Until the metrics collector counts a generated token for `worker_id` of `role`."""
        deadline = time.monotonic() + timeout_s
        while self.workers(role)[worker_id]["generated_tokens_total"] == 0:
            assert time.monotonic() < deadline, f"{worker_id} never generated a token: {self.workers(role)}"
            time.sleep(0.5)

    def router_metric(self, name: str) -> float:
        return metric_total(http_text(self.router_url + "/metrics"), name)

    def logs(self, *services: str) -> str:
        result = self.compose("logs", "--no-color", "--tail", "40", *services, check=False)
        return result.stdout[-6000:]

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes the project still has."""
        label = f"label=com.docker.compose.project={self.project}"
        found = {kind: run(["docker", kind, "ls", "-q", "--filter", label] + (["-a"] if kind == "container" else []),
                           check=False).stdout.split()
                 for kind in ("container", "network", "volume")}
        return {kind: ids for kind, ids in found.items() if ids}

    def down(self) -> subprocess.CompletedProcess[str]:
        return self.compose("down", "-v", "--remove-orphans", "--timeout", "30", check=False)
