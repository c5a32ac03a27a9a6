"""The launcher of an orchestrator that starts no workers (`--launcher none`): the control
plane refuses AddWorker before asking it, and it has nothing to stop or list."""

from __future__ import annotations

from services.orchestrator.launchers.base import LaunchedWorker, LaunchError, WorkerLaunch


class NoLauncher:
    async def start_worker(self, spec: WorkerLaunch) -> LaunchedWorker:
        raise LaunchError("this orchestrator has no worker launcher")

    async def stop_worker(self, handle: LaunchedWorker, timeout_s: float) -> int | None:
        return None

    def alive(self, handle: LaunchedWorker) -> bool:
        return False

    async def log_tail(self, handle: LaunchedWorker, lines: int = 20) -> str:
        return ""

    def list(self) -> list[LaunchedWorker]:
        return []

    async def recover(self) -> list[LaunchedWorker]:
        return []

    async def stop_all(self, timeout_s: float) -> None:
        return None
