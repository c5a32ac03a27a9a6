"""Worker launchers: how the orchestrator starts and stops worker processes for AddWorker
and RemoveWorker. `Launcher` is the contract (base.py); `LocalProcessLauncher` runs
`tandem worker` children on this machine; `DockerLauncher` runs them as containers on a
Docker engine (the compose stack's orchestrator); `NoLauncher` starts nothing (the orchestrator
refuses AddWorker). `build_launcher` picks one from `WorkerLauncherConfig.kind`.
"""

from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.launchers.base import LaunchedWorker, Launcher, LaunchError, WorkerLaunch
from services.orchestrator.launchers.local_process import LocalProcessLauncher, worker_argv
from services.orchestrator.launchers.none import NoLauncher


def build_launcher(config: OrchestratorConfig) -> Launcher:
    if config.launcher.kind == "local":
        return LocalProcessLauncher(config)
    if config.launcher.kind == "docker":
        from services.orchestrator.launchers.docker import DockerLauncher  # the SDK only where it is used

        return DockerLauncher(config)
    return NoLauncher()


__all__ = ["LaunchError", "LaunchedWorker", "Launcher", "LocalProcessLauncher", "NoLauncher", "WorkerLaunch",
           "build_launcher", "worker_argv"]
