"""Local-process launcher: starts and stops Tandem services as child processes.

Children run in their own session (a Ctrl-C reaches only the launcher, which then stops
them in order) and get a parent-death signal, so a launcher killed with SIGKILL leaves no
orphans behind. Each child's output goes to its own log file.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: Ctrl-C handling in the launcher still stops the children


class ManagedProcess:
    def __init__(self, name: str, argv: list[str], popen: subprocess.Popen[bytes], log_path: Path) -> None:
        self.name = name
        self.argv = argv
        self.popen = popen
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def find_line(self, pattern: str) -> re.Match[str] | None:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return None
        return re.search(pattern, text)

    def terminate(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL. Returns the exit code."""
        try:
            if self.alive:
                self.popen.send_signal(signal.SIGTERM)
                try:
                    return self.popen.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.popen.kill()
            return self.popen.wait()
        finally:
            self.kill_leftovers()

    def kill(self) -> None:
        if self.alive:
            self.popen.kill()
        self.popen.wait()
        self.kill_leftovers()

    def kill_leftovers(self) -> None:
        """SIGKILL whatever the process left in its process group (it leads its own session):
        a vLLM worker that died without shutting its engine down leaves the engine's
        processes running, and they hold gigabytes."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # nothing left


class LocalLauncher:
    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.processes: dict[str, ManagedProcess] = {}

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> ManagedProcess:
        """Start `python -m services.cli <args>` as child `name`."""
        if name in self.processes and self.processes[name].alive:
            raise ValueError(f"a process named {name!r} is already running")
        argv = [sys.executable, "-m", "services.cli", *args]
        log_path = self.log_dir / f"{name}.log"
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(log_path, "ab") as log_file:
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                     env=child_env, start_new_session=True, preexec_fn=_die_with_parent)
        process = ManagedProcess(name, argv, popen, log_path)
        self.processes[name] = process
        return process

    def wait_for_line(self, name: str, pattern: str, timeout_s: float) -> re.Match[str]:
        process = self.processes[name]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = process.find_line(pattern)
            if match:
                return match
            if not process.alive:
                raise RuntimeError(f"{name} exited with {process.popen.returncode}:\n{process.log_tail()}")
            time.sleep(0.05)
        raise TimeoutError(f"{name} did not print /{pattern}/ within {timeout_s}s:\n{process.log_tail()}")

    def stop(self, name: str, timeout_s: float = 10.0) -> int:
        return self.processes.pop(name).terminate(timeout_s)

    def stop_all(self, order: list[str] | None = None, timeout_s: float = 10.0) -> None:
        names = order or list(reversed(self.processes))
        for name in names:
            if name in self.processes:
                self.stop(name, timeout_s)
        for name in list(self.processes):
            self.stop(name, timeout_s)
