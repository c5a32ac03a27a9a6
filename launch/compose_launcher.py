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

import shlex
from collections.abc import Mapping

DOCKER_SOCKET = "/var/run/docker.sock"
COMPOSE_NETWORK = "default"  # the project's network, as the compose file names it
LAUNCHER_STOP_GRACE = "90s"  # SIGTERM: its launched workers drain (each within the command timeout)


def with_docker_launcher(orchestrator: dict[str, object], worker: dict[str, object], *, engine: str,
                         model_dir: str, worker_settings: list[str]) -> dict[str, object]:
    """`orchestrator` with `--launcher docker`, starting workers like `worker` (a rendered
    worker service) with `engine`, `model_dir` and the group's `worker_settings` flags."""
    service = dict(orchestrator)
    environment = worker.get("environment", {})
    assert isinstance(environment, dict)
    paths = [f"{name}={value}" for name, value in environment.items()
             if isinstance(value, str) and value.startswith("/")]  # file paths only, never a setting's value
    command = [*_list_entry(orchestrator, "command"), "--launcher", "docker", "--worker-compose",
               "--worker-image", worker["image"], "--worker-network", COMPOSE_NETWORK,
               "--worker-engine", engine, "--worker-model-dir", model_dir]
    for mount in _list_entry(worker, "volumes", optional=True):
        command += ["--worker-mount", mount]
    for entry in paths:
        command += ["--worker-env", entry]
    if worker_settings:
        command += ["--worker-args", shlex.join(worker_settings)]
    service["command"] = command
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
