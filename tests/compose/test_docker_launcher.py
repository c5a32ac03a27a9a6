"""The compose stack rendered with the Docker launcher (`tandem compose render
--docker-launcher`) on a real Docker engine: `tandem ctl add` (as the operator) makes the
orchestrator start a worker container of the stack's image on its network, which
registers and serves completions (real OpenAI client); `tandem ctl remove` drains it and
the container is gone; `down -v` leaves nothing, the launched containers included.

The image gets its own tag: a stack that starts while another test session rebuilds the
shared test tag keeps the image it was built for."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from launch.compose import render_compose
from launch.compose_secrets import nats_env
from launch.definition import default_definition_path, load_definition
from services.orchestrator.config import DockerLauncherConfig, OrchestratorConfig, WorkerLauncherConfig
from services.orchestrator.launchers import LaunchError, WorkerLaunch
from services.orchestrator.launchers.docker import DockerLauncher
from shared.schemas import WorkerRole
from tests.compose.docker_stack import ROOT, ComposeStack, base_image, compose_command, prepare_context, run

pytestmark = pytest.mark.timeout(900)

LAUNCHER_IMAGE = "tandem-test-docker-launcher:latest"
DOCKER_SOCKET = "/var/run/docker.sock"
ADDED = "w05"  # a worker slot: its id and NATS user (the stack's own workers hold the first ones)


@dataclass
class LauncherStack(ComposeStack):
    """A stack of a compose file rendered elsewhere, resolved as if it lay in compose/ (its
    build context, its .env)."""

    compose_file: Path = Path()

    def compose(self, *args: str, timeout_s: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run([*compose_command(), "-p", self.project, "-f", str(self.compose_file),
                    "--project-directory", str(ROOT / "compose"), *args],
                   env=self.env, timeout_s=timeout_s, check=check)

    @property
    def stack_label(self) -> str:
        return f"tandem.stack=tandem/{self.project}"

    def launched(self, *, all_states: bool = True) -> list[dict]:
        """The containers the orchestrator launched for this stack."""
        ids = run(["docker", "ps", "-q", *(["-a"] if all_states else []), "--filter", f"label={self.stack_label}"]
                  ).stdout.split()
        return json.loads(run(["docker", "inspect", *ids]).stdout) if ids else []

    def ctl(self, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
        """`tandem ctl ...` as the operator (its files in the secrets volume), from inside the stack."""
        operator = [flag for name, path in nats_env("operator").items() for flag in ("-e", f"{name}={path}")]
        return self.compose("exec", "-T", *operator, "orchestrator", "tandem", "ctl", *args,
                            "--nats-url", "nats://nats:4222", "--namespace", "tandem", timeout_s=timeout_s,
                            check=False)


@pytest.fixture(scope="module")
def launcher_stack(docker_engine: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LauncherStack]:
    if not os.path.exists(DOCKER_SOCKET):
        pytest.skip(f"the Docker launcher test needs the engine's socket at {DOCKER_SOCKET}")
    compose_file = tmp_path_factory.mktemp("compose") / "docker-compose.yml"
    compose_file.write_text(render_compose(load_definition(default_definition_path()), docker_launcher=True))
    prepare_context()
    gid = str(os.stat(DOCKER_SOCKET).st_gid)  # the orchestrator's user joins the socket's group
    stack = LauncherStack(images={"TANDEM_IMAGE": LAUNCHER_IMAGE, "TANDEM_NATS_IMAGE": LAUNCHER_IMAGE,
                                  "TANDEM_BASE_IMAGE": base_image(), "TANDEM_DOCKER_GID": gid},
                          compose_file=compose_file)
    try:
        started = time.monotonic()
        stack.compose("build", "model", timeout_s=1800)
        stack.up()
        print(f"\nstack {stack.project} (Docker launcher) ready in {time.monotonic() - started:.1f} s")
        yield stack
    finally:
        stack.down()
        for container in stack.launched():  # a failed test's leftovers: removed, and the test says so
            run(["docker", "rm", "-f", container["Id"]], check=False)


def client(stack: LauncherStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.router_url + "/v1", api_key=stack.api_key(), timeout=120, max_retries=0)


def test_ctl_add_starts_a_worker_container_that_serves(launcher_stack: LauncherStack) -> None:
    stack = launcher_stack
    stack.wait_router_workers(2)
    before = set(stack.workers("decode"))

    added = stack.ctl("add", "decode", "--worker-id", ADDED)
    assert added.returncode == 0, f"{added.stdout}\n{added.stderr}\n{stack.logs('orchestrator')}"

    (container,) = stack.launched()
    assert container["State"]["Running"]
    assert container["Name"] == f"/{stack.project}-{ADDED}"
    assert container["Config"]["Labels"]["tandem.worker"] == ADDED
    assert container["Config"]["Labels"]["tandem.role"] == "decode"
    assert container["Config"]["Image"] == LAUNCHER_IMAGE
    assert list(container["NetworkSettings"]["Networks"]) == [f"{stack.project}_default"]
    mounts = {mount["Destination"]: mount for mount in container["Mounts"]}
    assert mounts["/secrets"]["Name"] == f"{stack.project}_secrets" and not mounts["/secrets"]["RW"]
    assert mounts["/models"]["Name"] == f"{stack.project}_models" and not mounts["/models"]["RW"]
    assert mounts["/slots"]["Name"] == f"{stack.project}_slots"  # it claims its slot, as the stack's workers do
    command = container["Config"]["Cmd"]
    assert command[command.index("--worker-slots") + 1] == "/slots"
    assert command[command.index("--worker-id") + 1] == ADDED
    environment = container["Config"]["Env"]
    assert not any("TANDEM_NATS_" in entry or "password" in entry.lower() for entry in environment)

    assert set(stack.wait_workers("decode", len(before) + 1)) - before == {ADDED}
    stack.wait_ready(serving_workers=len(before) + 1)
    api = client(stack)
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda _: api.completions.create(model="tiny", prompt="hello " * 40, max_tokens=16),
                                range(16)))
    assert all(reply.usage.completion_tokens == 16 for reply in replies)
    stack.wait_generated("decode", ADDED, timeout_s=15)


def test_an_orchestrator_killed_and_restarted_adopts_its_worker(launcher_stack: LauncherStack) -> None:
    """A container outlives an orchestrator killed outright; the next one finds it by its labels."""
    stack = launcher_stack
    (orchestrator,) = stack.containers("orchestrator")
    run(["docker", "kill", "--signal", "KILL", orchestrator])
    assert [container["State"]["Running"] for container in stack.launched()] == [True]
    stack.compose("start", "orchestrator")
    deadline = time.monotonic() + 60
    while (listed := stack.ctl("workers", timeout_s=60)).returncode != 0:
        assert time.monotonic() < deadline, f"the orchestrator never came back:\n{listed.stdout}{listed.stderr}"
        time.sleep(0.5)
    assert "adopted from an earlier run" in stack.logs("orchestrator"), stack.logs("orchestrator")


def test_ctl_remove_drains_it_and_the_container_is_gone(launcher_stack: LauncherStack) -> None:
    stack = launcher_stack
    assert ADDED in stack.workers("decode")
    removed = stack.ctl("remove", ADDED, "--deadline", "20")
    assert removed.returncode == 0, f"{removed.stdout}\n{removed.stderr}\n{stack.logs('orchestrator')}"
    # The launcher stopped it (adopted, not a stranger). A drained worker exits by itself;
    # the launcher's SIGTERM may reach it during that exit (128 + 15).
    assert re.search(r"drained, left, process exited \((0|143)\)", removed.stdout), removed.stdout
    assert stack.launched() == []  # stopped and removed
    deadline = time.monotonic() + 15
    while ADDED in stack.workers("decode"):
        assert time.monotonic() < deadline, f"{ADDED} is still a member: {stack.workers('decode')}"
        time.sleep(0.5)
    reply = client(stack).completions.create(model="tiny", prompt="hello", max_tokens=4)  # the others serve on
    assert reply.usage.completion_tokens == 4


def test_a_failed_add_says_why_in_one_line(launcher_stack: LauncherStack) -> None:
    """A name that is taken (a container of the same name outside the orchestrator's care)."""
    stack = launcher_stack
    squatter = f"{stack.project}-w06"
    run(["docker", "create", "--name", squatter, LAUNCHER_IMAGE, "version"])
    try:
        failed = stack.ctl("add", "decode", "--worker-id", "w06", timeout_s=120)
        assert failed.returncode == 1, failed.stdout + failed.stderr
        assert f"container name {squatter} is taken" in failed.stdout, failed.stdout
    finally:
        run(["docker", "rm", "-f", squatter], check=False)


def test_a_missing_image_or_network_fails_in_one_line(launcher_stack: LauncherStack) -> None:
    """The launcher straight on the engine (no stack involved but the engine's)."""
    for docker, expected in ((DockerLauncherConfig(image="tandem-no-such-image:0", network="bridge"),
                              "image tandem-no-such-image:0 is not on the Docker engine (build or pull it first)"),
                             (DockerLauncherConfig(image=LAUNCHER_IMAGE, network="tandem-no-such-network"),
                              "the Docker network 'tandem-no-such-network' does not exist")):
        config = OrchestratorConfig(launcher=WorkerLauncherConfig(kind="docker", model_dir="/m", docker=docker))
        launcher = DockerLauncher(config)

        async def attempt(launcher: DockerLauncher = launcher) -> None:
            try:
                await launcher.start_worker(WorkerLaunch(worker_id="decode-x", role=WorkerRole.DECODE))
            finally:
                await launcher.stop_all(1.0)

        with pytest.raises(LaunchError) as failure:
            asyncio.run(attempt())
        assert str(failure.value) == expected


def test_down_stops_launched_workers_and_leaves_nothing(launcher_stack: LauncherStack) -> None:
    stack = launcher_stack
    added = stack.ctl("add", "prefill", "--worker-id", "w07")
    assert added.returncode == 0, f"{added.stdout}\n{added.stderr}\n{stack.logs('orchestrator')}"
    assert len(stack.launched(all_states=False)) == 1
    down = stack.down()
    assert down.returncode == 0, down.stdout + down.stderr
    assert stack.launched() == [], "the orchestrator's stop left a launched worker behind"
    assert stack.leftovers() == {}, down.stdout + down.stderr
