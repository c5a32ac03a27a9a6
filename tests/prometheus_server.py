"""A real Prometheus server (the Debian package's `prometheus` binary) for tests.

`PrometheusServer(config, workdir)` writes `config` to `workdir`, starts Prometheus on a
free loopback port with its storage there (exemplar storage on), and stops it on exit,
waiting for the process to end. The port is held (`launch.readiness.reserve_port`: Go's
listeners set SO_REUSEADDR, so Prometheus binds beside the hold) until Prometheus answers,
so no other program's bind or outgoing connection takes it in between. `query()` runs an
instant PromQL query through the HTTP API; `targets()` lists the active scrape targets.

`prometheus_binary()` finds the binary; a test that needs it skips without one, except
under CI (`CI=true`), where a missing Prometheus is a failure (`.ci/prepare-prometheus`
installs it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import pytest
import yaml

from launch.readiness import reserve_port
from shared.lifecycle import die_with_parent

INSTALL_HINT = "install it with `apt-get install -y prometheus` (or run .ci/prepare-prometheus)"


def prometheus_binary() -> str:
    """The `prometheus` binary's path; skips the test (fails it under CI) when there is none."""
    found = shutil.which("prometheus") or ("/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None)
    if found is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"Prometheus is not installed: {INSTALL_HINT}")
        pytest.skip(f"Prometheus is not installed: {INSTALL_HINT}")
    return found


class PrometheusServer:
    def __init__(self, config: dict[str, Any], workdir: Path, binary: str) -> None:
        self.workdir = workdir
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self._port_hold = reserve_port("127.0.0.1")  # closed once Prometheus answers (`ready`)
        self.port = self._port_hold.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "prometheus.log"
        self._argv = [binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={workdir / 'data'}",
                      f"--web.listen-address=127.0.0.1:{self.port}", "--enable-feature=exemplar-storage",
                      "--storage.tsdb.retention.time=1h", "--log.level=warn"]
        self._process: subprocess.Popen[bytes] | None = None
        self._http = httpx.Client(base_url=self.url, timeout=5.0)

    def __enter__(self) -> PrometheusServer:
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(self._argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                             start_new_session=True, preexec_fn=die_with_parent)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._http.close()
        self._port_hold.close()
        process = self._process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def ready(self) -> bool:
        assert self._process is not None
        if self._process.poll() is not None:
            raise AssertionError(f"prometheus exited with {self._process.returncode}:\n{self.log_tail()}")
        try:
            answered = self._http.get("/-/ready").status_code == 200
        except httpx.HTTPError:
            return False
        if answered:
            self._port_hold.close()  # Prometheus listens on the port now
        return answered

    def targets(self) -> list[dict[str, Any]]:
        return self._api("/api/v1/targets")["activeTargets"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The result of an instant query now; raises AssertionError on a PromQL error."""
        return self._api("/api/v1/query", {"query": expr, "time": f"{time.time():.3f}"})["result"]

    def label_values(self, label: str, metric: str) -> list[str]:
        return self._api(f"/api/v1/label/{label}/values", {"match[]": metric})

    def exemplars(self, expr: str, window_s: float = 600.0) -> list[dict[str, Any]]:
        now = time.time()
        return self._api("/api/v1/query_exemplars", {"query": expr, "start": f"{now - window_s:.3f}",
                                                     "end": f"{now:.3f}"})

    def _api(self, path: str, params: dict[str, str] | None = None) -> Any:
        response = self._http.get(path, params=params)
        body = response.json()
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]
