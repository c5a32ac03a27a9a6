"""Where the Docker launcher's containers go, resolved once against the engine (blocking
calls: the launcher runs them in a thread): the image, the network, the mounts, the
stack's label and the containers' name prefix.

Without `compose` the config's names are the engine's own. With it (the orchestrator runs
in a container of a compose stack) they are the compose file's: the orchestrator's own
container (its host name is its id) has a `com.docker.compose.project` label naming the
project, whose network and volumes compose labels with their names in the file (`default`,
`models`, `secrets`), so the launched workers join the stack whatever project name it was
started under.
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass

import docker
from docker.errors import DockerException, NotFound
from docker.types import Mount
from requests.exceptions import RequestException

from services.orchestrator.config import DockerLauncherConfig
from services.orchestrator.launchers.base import LaunchError

STACK_LABEL = "tandem.stack"
WORKER_LABEL = "tandem.worker"
ROLE_LABEL = "tandem.role"
COMPOSE_PROJECT = "com.docker.compose.project"
COMPOSE_NETWORK = "com.docker.compose.network"
COMPOSE_VOLUME = "com.docker.compose.volume"
# What an engine call can fail with: the engine's answers, and its connection's own errors
# (a read timeout on a busy engine).
ENGINE_ERRORS = (DockerException, RequestException)


@dataclass(frozen=True, slots=True)
class DockerTarget:
    image: str
    network: str
    mounts: tuple[Mount, ...]
    environment: dict[str, str]
    stack: str  # the `tandem.stack` label's value: `<namespace>` or `<namespace>/<project>`
    name_prefix: str  # a container's name is this and the worker id

    def labels(self, worker_id: str, role: str) -> dict[str, str]:
        return {STACK_LABEL: self.stack, WORKER_LABEL: worker_id, ROLE_LABEL: role}


def one_line(error: BaseException) -> str:
    """An engine error as one short line (the SDK's can span lines, with a whole response)."""
    text = " ".join(str(error).split())
    return text if len(text) <= 240 else text[:237] + "..."


def connect(config: DockerLauncherConfig) -> docker.DockerClient:
    try:
        client = docker.DockerClient(base_url=config.host, timeout=math.ceil(config.engine_timeout_s))
        client.ping()
    except ENGINE_ERRORS as error:
        raise LaunchError(f"the Docker engine at {config.host} does not answer: {one_line(error)}") from error
    return client


def resolve(client: docker.DockerClient, config: DockerLauncherConfig, namespace: str) -> DockerTarget:
    """The target of `config`'s names on this engine; `LaunchError` for what is not there."""
    try:
        project = _compose_project(client, socket.gethostname()) if config.compose else ""
        network = _named(client.networks.list(filters={"label": [f"{COMPOSE_PROJECT}={project}",
                                                                 f"{COMPOSE_NETWORK}={config.network}"]}),
                         f"{project}_{config.network}") if project else config.network
        client.networks.get(network)
    except NotFound as error:
        raise LaunchError(f"the Docker network {network!r} does not exist") from error
    except ENGINE_ERRORS as error:
        raise LaunchError(f"the Docker engine at {config.host} failed: {one_line(error)}") from error
    mounts = tuple(_mount(client, spec, project) for spec in config.mounts)
    environment = dict(entry.partition("=")[::2] for entry in config.env)
    stack = f"{namespace}/{project}" if project else namespace
    return DockerTarget(image=config.image, network=network, mounts=mounts, environment=environment,
                        stack=stack, name_prefix=f"{project or namespace}-")


def _compose_project(client: docker.DockerClient, container: str) -> str:
    try:
        labels = client.containers.get(container).labels
    except NotFound as error:
        raise LaunchError(f"the orchestrator's own container {container!r} is not on this engine") from error
    except ENGINE_ERRORS as error:
        raise LaunchError(f"could not inspect the orchestrator's container {container!r}: {one_line(error)}") \
            from error
    project = labels.get(COMPOSE_PROJECT, "")
    if not project:
        raise LaunchError(f"container {container!r} is not part of a compose project (no {COMPOSE_PROJECT} label)")
    return project


def _named(found: list, fallback: str) -> str:
    """The one engine object compose labelled so, else compose's usual `<project>_<name>`."""
    return found[0].name if len(found) == 1 else fallback


def _mount(client: docker.DockerClient, spec: str, project: str) -> Mount:
    source, target, *mode = spec.split(":")
    read_only = mode == ["ro"]
    if source.startswith("/"):
        return Mount(target, source, type="bind", read_only=read_only)
    if project:
        try:
            found = client.volumes.list(filters={"label": [f"{COMPOSE_PROJECT}={project}",
                                                           f"{COMPOSE_VOLUME}={source}"]})
        except ENGINE_ERRORS as error:
            raise LaunchError(f"could not list the Docker volumes: {one_line(error)}") from error
        source = _named(found, f"{project}_{source}")
    try:
        client.volumes.get(source)
    except NotFound as error:
        raise LaunchError(f"the Docker volume {source!r} does not exist (mount {spec!r})") from error
    except ENGINE_ERRORS as error:
        raise LaunchError(f"could not inspect the Docker volume {source!r}: {one_line(error)}") from error
    return Mount(target, source, type="volume", read_only=read_only)
