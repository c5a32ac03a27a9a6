"""The Docker launcher's config checks, its one-line failures when the engine cannot be
reached (a socket path that does not exist), and the compose render option that gives it
to the stack's orchestrator. No Docker engine needed."""

from __future__ import annotations

import pytest

from launch.compose import compose_document
from launch.definition import default_definition_path, load_definition
from services.orchestrator.config import DockerLauncherConfig, OrchestratorConfig, WorkerLauncherConfig
from services.orchestrator.launchers import LaunchedWorker, LaunchError, WorkerLaunch, build_launcher
from services.orchestrator.launchers.docker import DockerLauncher
from shared.config import BusConfig, ConfigError
from shared.schemas import WorkerRole

GOOD = DockerLauncherConfig(image="tandem:latest", network="tandem_default", mounts=("models:/models:ro",),
                            env=("TANDEM_NATS_CREDS_FILE=/secrets/nats/creds/worker.creds",))


def docker_config(docker: DockerLauncherConfig = GOOD, model_dir: str = "/models/tiny") -> OrchestratorConfig:
    return OrchestratorConfig(bus=BusConfig(namespace="ns"),
                              launcher=WorkerLauncherConfig(kind="docker", model_dir=model_dir, docker=docker))


def test_a_complete_docker_config_validates_and_builds_the_docker_launcher() -> None:
    config = docker_config()
    config.validate()
    assert isinstance(build_launcher(config), DockerLauncher)
    WorkerLauncherConfig(kind="local", model_dir="/m").validate()  # the docker fields leave the others alone


@pytest.mark.parametrize(("docker", "model_dir", "message"), [
    (DockerLauncherConfig(network="n"), "/m", "needs an image"),
    (DockerLauncherConfig(image="i"), "/m", "needs a network name"),
    (GOOD, "", "the docker launcher needs a model directory"),
    (DockerLauncherConfig(image="i", network="n", host="/var/run/docker.sock"), "/m", "must be a unix://"),
    (DockerLauncherConfig(image="i", network="n", mounts=("models",)), "/m", "mount 'models' must be"),
    (DockerLauncherConfig(image="i", network="n", mounts=("models:relative",)), "/m", "must be SOURCE:/container"),
    (DockerLauncherConfig(image="i", network="n", mounts=("models:/m:rx",)), "/m", "must be SOURCE:/container"),
    (DockerLauncherConfig(image="i", network="n", env=("TANDEM_API_KEY=sk-123",)), "/m",
     "TANDEM_API_KEY must be an absolute file path (never a secret itself)"),
    (DockerLauncherConfig(image="i", network="n", env=("BAD NAME=/x",)), "/m", "must be NAME=/file/path"),
])
def test_docker_config_errors_say_what_is_wrong(docker: DockerLauncherConfig, model_dir: str, message: str) -> None:
    with pytest.raises(ConfigError, match="^.*" + message.replace("(", r"\(").replace(")", r"\)")):
        docker_config(docker, model_dir).validate()


def test_an_unknown_launcher_kind_is_refused() -> None:
    with pytest.raises(ConfigError, match="must be none, local or docker"):
        WorkerLauncherConfig(kind="ssh", model_dir="/m").validate()  # type: ignore[arg-type]


async def test_an_unreachable_engine_fails_each_call_with_one_line(tmp_path) -> None:
    host = f"unix://{tmp_path}/no-such-docker.sock"
    launcher = DockerLauncher(docker_config(DockerLauncherConfig(host=host, image="i", network="n")))
    for attempt in (launcher.start_worker(WorkerLaunch(worker_id="d1", role=WorkerRole.DECODE)), launcher.recover()):
        with pytest.raises(LaunchError) as failure:
            await attempt
        line = str(failure.value)
        assert line.startswith(f"the Docker engine at {host} does not answer: ") and "\n" not in line, line
        assert len(line) < 400
    stranger = LaunchedWorker(worker_id="d1", role=WorkerRole.DECODE, pid=0, container_id="abc")
    assert await launcher.stop_worker(stranger, 1.0) is None  # not its own: nothing to stop
    assert not launcher.alive(stranger) and launcher.list() == []
    assert await launcher.log_tail(stranger) == ""
    await launcher.stop_all(1.0)


def test_the_compose_docker_launcher_is_opt_in_and_follows_the_worker_services() -> None:
    definition = load_definition(default_definition_path())
    plain = compose_document(definition)["services"]
    assert "--launcher" not in plain["orchestrator"]["command"]  # type: ignore[index]
    assert not any("docker.sock" in volume for volume in plain["orchestrator"]["volumes"])  # type: ignore[index]

    services = compose_document(definition, docker_launcher=True)["services"]
    orchestrator, worker = services["orchestrator"], services["prefill"]  # type: ignore[index]
    command = orchestrator["command"]

    def values(flag: str) -> list[str]:
        return [command[index + 1] for index, item in enumerate(command) if item == flag]

    assert values("--launcher") == ["docker"] and "--worker-compose" in command
    assert values("--worker-image") == [worker["image"]] and values("--worker-network") == ["default"]
    assert values("--worker-mount") == worker["volumes"]
    assert values("--worker-env") == [f"{name}={value}" for name, value in worker["environment"].items()
                                      if value.startswith("/")]
    assert not any(entry.startswith("TANDEM_NATS_") for entry in values("--worker-env"))  # a slot's user, not env
    assert values("--worker-model-dir") == ["/models/tiny"]
    assert values("--worker-args") == ["--sim-speedup 1.0 --worker-slots /slots --worker-slot-nats-dir /secrets/nats"]
    assert "slots:/slots" in values("--worker-mount")
    assert "${TANDEM_DOCKER_SOCKET:-/var/run/docker.sock}:/var/run/docker.sock" in orchestrator["volumes"]
    assert orchestrator["group_add"] == ["${TANDEM_DOCKER_GID:-0}"]
    # only the orchestrator changes
    assert {name: body for name, body in services.items() if name != "orchestrator"} == \
        {name: body for name, body in plain.items() if name != "orchestrator"}
    DockerLauncherConfig(image=values("--worker-image")[0], network="default", mounts=tuple(values("--worker-mount")),
                         env=tuple(values("--worker-env"))).validate()
