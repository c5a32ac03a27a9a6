"""Local-process launcher: starts and stops Tandem services as child processes.

Children run in their own session (a Ctrl-C reaches only the launcher, which then stops
them in order) and get a parent-death signal, so a launcher killed with SIGKILL leaves no
orphans behind. Each child's output goes to its own log file; whether a child is ready is
for `launch.readiness` to tell (health endpoints, membership), never its log lines.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from shared.lifecycle import die_with_parent


def start_or_undo(start: Callable[[], None], undo: Callable[[], None]) -> None:
    """`start()`; if it fails (KeyboardInterrupt too), `undo()` first, so that nothing it
    started stays running, then the failure goes on."""
    try:
        start()
    except BaseException:
        undo()
        raise


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

    def wait_or_kill(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for the exit, then SIGKILL; then clear the process group."""
        try:
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
        """Start `python -m cli.main <args>` (`tandem <args>`) as child `name`."""
        return self.start_program(name, [sys.executable, "-m", "cli.main", *args], env)

    def start_program(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> ManagedProcess:
        """Start any program as child `name` (a benchmark's peer system)."""
        if name in self.processes and self.processes[name].alive:
            raise ValueError(f"a process named {name!r} is already running")
        log_path = self.log_dir / f"{name}.log"
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(log_path, "ab") as log_file:
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                     env=child_env, start_new_session=True, preexec_fn=die_with_parent)
        process = ManagedProcess(name, argv, popen, log_path)
        self.processes[name] = process
        return process

    def stop(self, name: str, timeout_s: float = 10.0) -> None:
        self.stop_together([name], timeout_s)

    def stop_together(self, names: list[str], timeout_s: float = 10.0) -> None:
        """SIGTERM all of `names` at once, then wait for each (SIGKILL past `timeout_s`):
        workers drain and shut their engines down in parallel, not one after the other."""
        stopping = [self.processes.pop(name) for name in names if name in self.processes]
        for process in stopping:
            if process.alive:
                process.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for process in stopping:
            process.wait_or_kill(max(0.0, deadline - time.monotonic()))

    def stop_all(self, order: list[list[str]] | None = None, timeout_s: float = 10.0) -> None:
        """Stop in stages (each stage together), then whatever was not named."""
        for stage in order or [[name] for name in reversed(self.processes)]:
            self.stop_together(stage, timeout_s)
        self.stop_together(list(self.processes), timeout_s)
