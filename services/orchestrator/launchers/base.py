"""The launcher contract: start a worker from a `WorkerLaunch`, get a `LaunchedWorker`
handle back; stop it by that handle; list what is running. The orchestrator's control
plane calls it; readiness is the worker's registration in the members bucket, which the
control plane watches, never the launcher's word.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from shared.schemas import WorkerRole


class LaunchError(Exception):
    """The worker could not be started (an expected failure: the command answers `failed`)."""


@dataclass(frozen=True, slots=True)
class WorkerLaunch:
    worker_id: str
    role: WorkerRole
    extra_args: tuple[str, ...] = ()  # `tandem worker` flags after the launcher's own (the later ones win)


@dataclass(frozen=True, slots=True)
class LaunchedWorker:
    worker_id: str
    role: WorkerRole  # the role it was started in (a later SetRole may change it)
    pid: int  # the worker's process (for a container: its main process on the host, 0 once unknown)
    container_id: str = ""  # the Docker launcher's container; empty for a process


class Launcher(Protocol):
    async def start_worker(self, spec: WorkerLaunch) -> LaunchedWorker:
        """Start the worker's process; raises `LaunchError` when it cannot."""
        ...

    async def stop_worker(self, handle: LaunchedWorker, timeout_s: float) -> int | None:
        """SIGTERM (the worker drains and deregisters), SIGKILL past `timeout_s`; the exit
        status, None if it is not this launcher's."""
        ...

    def alive(self, handle: LaunchedWorker) -> bool: ...

    async def log_tail(self, handle: LaunchedWorker, lines: int = 20) -> str: ...

    def list(self) -> list[LaunchedWorker]:
        """The workers this launcher started that have not been stopped."""
        ...

    async def recover(self) -> list[LaunchedWorker]:
        """Workers an earlier run of this orchestrator started that still run (a container
        outlives an orchestrator killed outright), adopted so `list` and `stop_worker` cover
        them; raises `LaunchError` when the launcher cannot tell."""
        ...

    async def stop_all(self, timeout_s: float) -> None: ...
