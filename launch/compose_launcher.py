"""The compose stack's orchestrator given the Docker launcher (`tandem compose render
--docker-launcher`, off by default), so `tandem ctl add` and the planner start workers as
containers of the stack. Pure: the orchestrator's service in, the same with the launcher out.

The launched workers get what the compose worker services get, read from a rendered worker
service (one place: they follow its image, volumes and file-path environment), and the
orchestrator's own bus and membership flags. The orchestrator mounts the engine's socket:
whoever controls it is root on the host, hence opt-in. Its user joins the socket's group
(TANDEM_DOCKER_GID, the host's `stat -c %g /var/run/docker.sock`).
"""

from __future__ import annotations

from collections.abc import Mapping

from launch.service_commands import ORCHESTRATOR_COMMAND
from services.orchestrator.config import DockerLauncherConfig, OrchestratorConfig, WorkerLauncherConfig

DOCKER_SOCKET = "/var/run/docker.sock"
COMPOSE_NETWORK = "default"  # the project's network, as the compose file names it
LAUNCHER_STOP_GRACE = "90s"  # SIGTERM: its launched workers drain (each within the command timeout)
DOCKER_LAUNCHER_FIELDS = ("launcher.kind", "launcher.engine", "launcher.model_dir", "launcher.docker.image",
                          "launcher.docker.network", "launcher.docker.mounts", "launcher.docker.env",
                          "launcher.docker.compose")


def with_docker_launcher(orchestrator: dict[str, object], worker: dict[str, object], *, engine: str,
                         model_dir: str, worker_settings: list[str]) -> dict[str, object]:
    """`orchestrator` with `--launcher docker`, starting workers like `worker` (a rendered
    worker service) with `engine`, `model_dir` and the group's `worker_settings` flags."""
    service = dict(orchestrator)
    environment = worker.get("environment", {})
    assert isinstance(environment, dict)
    paths = [f"{name}={value}" for name, value in environment.items()
             if isinstance(value, str) and value.startswith("/")]  # file paths only, never a setting's value
    docker = DockerLauncherConfig(image=str(worker["image"]), network=COMPOSE_NETWORK, compose=True,
                                  mounts=tuple(str(mount) for mount in _list_entry(worker, "volumes", optional=True)),
                                  env=tuple(paths))
    launcher = WorkerLauncherConfig(kind="docker", engine=engine, model_dir=model_dir,
                                    worker_args=tuple(worker_settings), docker=docker)
    fields = [*DOCKER_LAUNCHER_FIELDS, *(["launcher.worker_args"] if worker_settings else [])]
    service["command"] = [*_list_entry(orchestrator, "command"),
                          *ORCHESTRATOR_COMMAND.flags(OrchestratorConfig(launcher=launcher), fields)]
    service["volumes"] = [*_list_entry(orchestrator, "volumes", optional=True),
                          f"${{TANDEM_DOCKER_SOCKET:-{DOCKER_SOCKET}}}:{DOCKER_SOCKET}"]
    service["group_add"] = ["${TANDEM_DOCKER_GID:-0}"]
    service["stop_grace_period"] = LAUNCHER_STOP_GRACE
    return service


def _list_entry(service: Mapping[str, object], key: str, *, optional: bool = False) -> list[object]:
    """A rendered service's list (its command, its volumes); `optional`: [] where it has none."""
    value = service.get(key, []) if optional else service[key]
    assert isinstance(value, list), f"{key}: {value!r}"
    return value
