"""Workers as containers on a Docker engine (`--launcher docker`): the stack's image on the
stack's network, with the mounts and the environment (file paths) the config names, the
command `tandem worker ...` with the orchestrator's bus and membership settings
(`worker_command`). Each container is named `<project or namespace>-<worker id>` and
labelled `tandem.stack`, `tandem.worker` and `tandem.role`, so a restarted orchestrator
finds its workers again (`recover`).

The engine is reached through the Docker SDK, whose calls block: each runs in a thread.
`alive` answers from what the engine last said: a monitor task lists the stack's running
containers every `poll_interval_s` while there are workers. Stop: SIGTERM (the worker
drains and deregisters), SIGKILL past the timeout, then the container is removed. Expected
failures (no engine, no image, a name taken) raise `LaunchError` with one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math

import docker
from docker.errors import DockerException, ImageNotFound, NotFound

from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.launchers.base import LaunchedWorker, LaunchError, WorkerLaunch
from services.orchestrator.launchers.docker_target import (
    ENGINE_ERRORS,
    ROLE_LABEL,
    STACK_LABEL,
    WORKER_LABEL,
    DockerTarget,
    connect,
    one_line,
    resolve,
)
from services.orchestrator.launchers.worker_command import worker_command
from shared.schemas import WorkerRole

log = logging.getLogger(__name__)

EXIT_WAIT_S = 30  # for the exit status of a container the engine has just stopped


class DockerLauncher:
    def __init__(self, config: OrchestratorConfig, *, poll_interval_s: float = 0.5) -> None:
        self._config = config
        self._docker = config.launcher.docker
        self._poll_interval_s = poll_interval_s
        self._engine: tuple[docker.DockerClient, DockerTarget] | None = None
        self._engine_lock = asyncio.Lock()
        self._workers: dict[str, LaunchedWorker] = {}
        self._running: set[str] = set()  # container ids the engine last listed as running
        self._started: set[str] = set()  # started since the monitor's listing began
        self._monitor: asyncio.Task[None] | None = None

    async def start_worker(self, spec: WorkerLaunch) -> LaunchedWorker:
        client, target = await self._connected()
        running = self._workers.get(spec.worker_id)
        if running is not None and self.alive(running):
            raise LaunchError(f"worker {spec.worker_id} is already running (container {running.container_id[:12]})")
        handle = await asyncio.to_thread(self._run_container, client, target, spec)
        self._workers[spec.worker_id] = handle
        self._running.add(handle.container_id)
        self._started.add(handle.container_id)
        self._watch()
        return handle

    def _run_container(self, client: docker.DockerClient, target: DockerTarget, spec: WorkerLaunch) -> LaunchedWorker:
        name = target.name_prefix + spec.worker_id
        try:
            client.images.get(target.image)  # never a pull: the stack's image is already here
            container = client.containers.create(
                target.image, worker_command(self._config, spec), name=name,
                labels=target.labels(spec.worker_id, spec.role.value), environment=target.environment,
                mounts=list(target.mounts), network=target.network, init=True, detach=True)
        except ImageNotFound as error:
            raise LaunchError(f"image {target.image} is not on the Docker engine (build or pull it first)") from error
        except ENGINE_ERRORS as error:
            if isinstance(error, DockerException) and \
                    getattr(getattr(error, "response", None), "status_code", 0) == 409:
                raise LaunchError(f"container name {name} is taken (docker rm -f {name} if it is a leftover)") \
                    from error
            raise LaunchError(f"could not create worker {spec.worker_id}'s container: {one_line(error)}") from error
        try:
            container.start()
            container.reload()
        except ENGINE_ERRORS as error:
            with contextlib.suppress(*ENGINE_ERRORS):
                container.remove(force=True)
            raise LaunchError(f"could not start worker {spec.worker_id}'s container: {one_line(error)}") from error
        return LaunchedWorker(worker_id=spec.worker_id, role=spec.role, pid=int(container.attrs["State"]["Pid"] or 0),
                              container_id=container.id or "")

    async def stop_worker(self, handle: LaunchedWorker, timeout_s: float) -> int | None:
        if self._workers.get(handle.worker_id) != handle or self._engine is None:
            return None
        client = self._engine[0]
        try:
            status = await asyncio.to_thread(_stop_container, client, handle.container_id, timeout_s)
        except ENGINE_ERRORS as error:
            log.warning("could not stop worker %s's container %s: %s", handle.worker_id, handle.container_id[:12],
                        one_line(error))
            status = None
        if self._workers.get(handle.worker_id) == handle:
            del self._workers[handle.worker_id]
        self._running.discard(handle.container_id)
        return status

    def alive(self, handle: LaunchedWorker) -> bool:
        return self._workers.get(handle.worker_id) == handle and handle.container_id in self._running

    async def log_tail(self, handle: LaunchedWorker, lines: int = 20) -> str:
        if self._engine is None or not handle.container_id:
            return ""
        client = self._engine[0]

        def tail() -> str:
            return client.containers.get(handle.container_id).logs(tail=lines).decode(errors="replace")

        try:
            return (await asyncio.to_thread(tail)).rstrip("\n")
        except ENGINE_ERRORS as error:
            return f"(no log: {one_line(error)})"

    def list(self) -> list[LaunchedWorker]:
        return list(self._workers.values())

    async def recover(self) -> list[LaunchedWorker]:
        """Adopt the stack's running worker containers; remove its exited ones (their names
        would be taken)."""
        client, target = await self._connected()

        def scan() -> list[LaunchedWorker]:
            adopted = []
            for container in client.containers.list(all=True, filters={"label": f"{STACK_LABEL}={target.stack}"}):
                labels = container.labels
                if container.status != "running":
                    container.remove(force=True)
                    continue
                adopted.append(LaunchedWorker(worker_id=labels[WORKER_LABEL], role=WorkerRole(labels[ROLE_LABEL]),
                                              pid=int(container.attrs["State"]["Pid"] or 0),
                                              container_id=container.id or ""))
            return adopted

        try:
            adopted = await asyncio.to_thread(scan)
        except (*ENGINE_ERRORS, KeyError, ValueError) as error:
            raise LaunchError(f"could not list the stack's worker containers: {one_line(error)}") from error
        for handle in adopted:
            self._workers[handle.worker_id] = handle
            self._running.add(handle.container_id)
        if adopted:
            self._watch()
        return adopted

    async def stop_all(self, timeout_s: float) -> None:
        await asyncio.gather(*(self.stop_worker(handle, timeout_s) for handle in self.list()))
        if self._engine is not None:
            # A container the engine made after its call timed out is labelled but not known here.
            client, target = self._engine
            try:
                await asyncio.to_thread(_remove_labelled, client, target.stack)
            except ENGINE_ERRORS as error:
                log.warning("docker launcher: could not look for stray worker containers: %s", one_line(error))
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
            self._monitor = None
        if self._engine is not None:
            self._engine[0].close()
            self._engine = None

    async def _connected(self) -> tuple[docker.DockerClient, DockerTarget]:
        """The engine's client and the resolved target, made on first use (and retried
        after a failure: the engine may come later than the orchestrator)."""
        async with self._engine_lock:
            if self._engine is None:
                namespace = self._config.bus.namespace

                def make() -> tuple[docker.DockerClient, DockerTarget]:
                    client = connect(self._docker)
                    try:
                        return client, resolve(client, self._docker, namespace)
                    except LaunchError:
                        client.close()
                        raise

                self._engine = await asyncio.to_thread(make)
            return self._engine

    def _watch(self) -> None:
        if self._monitor is None or self._monitor.done():
            self._monitor = asyncio.create_task(self._poll_running(), name="docker-launcher-monitor")

    async def _poll_running(self) -> None:
        """Keeps `_running` current while this launcher has workers. Engine trouble keeps the
        last answer (a worker's own registration still says whether it serves)."""
        reported = False
        while self._workers and self._engine is not None:
            client, target = self._engine
            self._started = set()
            try:
                found = await asyncio.to_thread(
                    client.containers.list, filters={"label": f"{STACK_LABEL}={target.stack}", "status": "running"})
                # A container started while the engine was listing is running, listed or not.
                self._running = {container.id for container in found if container.id} | self._started
                reported = False
            except ENGINE_ERRORS as error:
                if not reported:
                    log.warning("docker launcher: could not list the running workers: %s", one_line(error))
                    reported = True
            # A poll of an outside system, not a synchronisation: the engine tells no one.
            await asyncio.sleep(self._poll_interval_s)


def _stop_container(client: docker.DockerClient, container_id: str, timeout_s: float) -> int | None:
    """SIGTERM, SIGKILL past `timeout_s` (the engine does both), the exit status, then gone."""
    try:
        container = client.containers.get(container_id)
    except NotFound:
        return None  # removed by someone else
    container.stop(timeout=max(1, math.ceil(timeout_s)))
    status = int(container.wait(timeout=EXIT_WAIT_S)["StatusCode"])
    container.remove(force=True)
    return status


def _remove_labelled(client: docker.DockerClient, stack: str) -> None:
    for container in client.containers.list(all=True, filters={"label": f"{STACK_LABEL}={stack}"}):
        log.warning("docker launcher: removing stray worker container %s", container.name)
        container.remove(force=True)
