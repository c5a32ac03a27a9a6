"""Workers as child processes of the orchestrator on this machine: `python -m cli.main
worker ...` (what `tandem worker` runs), with the orchestrator's bus and membership
settings, the launcher config's engine, model and extra flags.

Each child leads its own session (so its engine's processes can be cleared with it) and
gets a parent-death signal, so an orchestrator killed outright leaves no worker behind.
Its output goes to `<log_dir>/<worker_id>.log`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.launchers.base import LaunchedWorker, LaunchError, WorkerLaunch
from services.orchestrator.launchers.worker_command import worker_command
from shared.lifecycle import die_with_parent


def worker_argv(config: OrchestratorConfig, spec: WorkerLaunch) -> list[str]:
    """The command line of one worker (the `tandem worker` command, run by module path:
    the orchestrator must not import the CLI layer, only start it)."""
    return [sys.executable, "-m", "cli.main", *worker_command(config, spec)]


class LocalProcessLauncher:
    def __init__(self, config: OrchestratorConfig) -> None:
        self._config = config
        self._log_dir = Path(config.launcher.log_dir)
        self._processes: dict[str, tuple[LaunchedWorker, asyncio.subprocess.Process]] = {}

    async def start_worker(self, spec: WorkerLaunch) -> LaunchedWorker:
        running = self._processes.get(spec.worker_id)
        if running is not None and running[1].returncode is None:
            raise LaunchError(f"worker {spec.worker_id} is already running (pid {running[0].pid})")
        try:
            self._log_dir.mkdir(parents=True, exist_ok=True)
            with open(self._log_dir / f"{spec.worker_id}.log", "ab") as log_file:
                process = await asyncio.create_subprocess_exec(
                    *worker_argv(self._config, spec), stdin=asyncio.subprocess.DEVNULL, stdout=log_file,
                    stderr=asyncio.subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                    start_new_session=True, preexec_fn=die_with_parent)
        except OSError as error:
            raise LaunchError(f"could not start worker {spec.worker_id}: {error}") from error
        handle = LaunchedWorker(worker_id=spec.worker_id, role=spec.role, pid=process.pid)
        self._processes[spec.worker_id] = (handle, process)
        return handle

    async def stop_worker(self, handle: LaunchedWorker, timeout_s: float) -> int | None:
        entry = self._processes.get(handle.worker_id)
        if entry is None or entry[0] != handle:
            return None
        process = entry[1]
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        try:
            status = await asyncio.wait_for(process.wait(), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            status = await process.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # whatever its engine left in its group
        del self._processes[handle.worker_id]
        return status

    def alive(self, handle: LaunchedWorker) -> bool:
        entry = self._processes.get(handle.worker_id)
        return entry is not None and entry[0] == handle and entry[1].returncode is None

    async def log_tail(self, handle: LaunchedWorker, lines: int = 20) -> str:
        try:
            text = (self._log_dir / f"{handle.worker_id}.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def list(self) -> list[LaunchedWorker]:
        return [handle for handle, _ in self._processes.values()]

    async def recover(self) -> list[LaunchedWorker]:
        return []  # children die with the orchestrator: an earlier run left none

    async def stop_all(self, timeout_s: float) -> None:
        await asyncio.gather(*(self.stop_worker(handle, timeout_s) for handle in self.list()))
