"""The orchestrator's config (`tandem orchestrator`): the limits its commands keep, how it
starts workers (`WorkerLauncherConfig`, Docker's `DockerLauncherConfig`) and its SLO planner
(`PlannerLoopConfig`). Each field that is a flag declares it (`shared.config_fields`).
"""

from __future__ import annotations

import re
import shlex
from typing import Annotated, Literal

import msgspec

from shared.config import BusConfig, MembershipConfig, TracingConfig, require
from shared.config_fields import flag
from shared.scalable_models import ScalableModel, scalable_models


class WorkerLimits(msgspec.Struct, kw_only=True, frozen=True):
    """What orchestrator commands may not cross; a command that would is refused."""

    # ACTIVE decode/both workers of a model (drain, remove, set-role, cordon)
    min_serving_workers: Annotated[int, flag("Refuse commands leaving fewer active decode workers.")] = 1
    # ACTIVE prefill workers of a model (same commands)
    min_prefill_workers: Annotated[int, flag("Refuse commands leaving fewer active prefill workers.")] = 0
    # registered workers in all (add)
    max_workers: Annotated[int, flag("Worker budget for `add` (0: none).")] = 0
    max_prefill_workers: Annotated[int, flag("0: no limit.")] = 0  # add, set-role
    max_serving_workers: Annotated[int, flag("Decode/both workers; 0: no limit.")] = 0  # add, set-role

    def validate(self) -> None:
        require(min(self.min_serving_workers, self.min_prefill_workers, self.max_workers, self.max_prefill_workers,
                    self.max_serving_workers) >= 0, "worker limits must not be negative")


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DOCKER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class DockerLauncherConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Where and how the Docker launcher runs worker containers: the engine's address, the
    image, the network, the mounts (`SOURCE:TARGET[:ro]`, SOURCE a volume or an absolute
    host path) and the environment (`NAME=/a/file/path`: paths only, a container's
    environment is visible to whoever may inspect it). With `compose` (the orchestrator runs
    in a container of a compose stack), the network and the volumes are the compose file's
    names, looked up in that container's compose project."""

    host: Annotated[str, flag("Docker launcher: the engine's address.", name="--docker-host")] = \
        "unix:///var/run/docker.sock"
    image: Annotated[str, flag("Docker launcher: the workers' image.", name="--worker-image")] = ""
    network: Annotated[str, flag("Docker launcher: the workers' network.", name="--worker-network")] = ""
    mounts: Annotated[tuple[str, ...], flag("Docker launcher: SOURCE:/path[:ro] (repeat).", name="--worker-mount")] = ()
    env: Annotated[tuple[str, ...], flag("Docker launcher: NAME=/file/path (repeat).", name="--worker-env")] = ()
    compose: Annotated[bool, flag(
        "Docker launcher: network and volume names are the compose file's, in the compose project of the "
        "container this orchestrator runs in.", name="--worker-compose")] = False
    engine_timeout_s: float = 120.0  # one engine call (creating a container copies the image on vfs)

    def validate(self) -> None:
        require(self.engine_timeout_s > 0, "the Docker engine timeout must be positive")
        require(self.host.startswith(("unix://", "tcp://", "ssh://", "npipe://")),
                f"docker host {self.host!r} must be a unix://, tcp://, ssh:// or npipe:// address")
        require(bool(self.image), "the docker launcher needs an image (--worker-image)")
        require(bool(_DOCKER_NAME.fullmatch(self.network)),
                f"the docker launcher needs a network name (--worker-network), not {self.network!r}")
        for mount in self.mounts:
            parts = mount.split(":")
            require(len(parts) in (2, 3) and all(parts[:2]) and parts[1].startswith("/")
                    and (len(parts) == 2 or parts[2] in ("ro", "rw"))
                    and (parts[0].startswith("/") or bool(_DOCKER_NAME.fullmatch(parts[0]))),
                    f"mount {mount!r} must be SOURCE:/container/path[:ro|rw] (SOURCE a volume or /host/path)")
        for entry in self.env:
            name, _, value = entry.partition("=")
            require(bool(_ENV_NAME.fullmatch(name)), f"worker environment {entry!r} must be NAME=/file/path")
            require(value.startswith("/") and "\n" not in value,
                    f"worker environment {name} must be an absolute file path (never a secret itself)")


LAUNCHERS = ("none", "local", "docker")


def _known_launcher(kind: str) -> str:
    require(kind in LAUNCHERS, "must be none, local or docker")
    return kind


def _split_args(worker_args: str) -> tuple[str, ...]:
    return tuple(shlex.split(worker_args))


class WorkerLauncherConfig(msgspec.Struct, kw_only=True, frozen=True):
    """How the orchestrator starts workers for AddWorker: "none" refuses, "local" runs
    `tandem worker` child processes on this machine, "docker" runs them as containers
    (`docker`: where and how)."""

    kind: Annotated[Literal["none", "local", "docker"], flag(
        "How `tandem ctl add` starts workers: none | local | docker.", name="--launcher",
        parse=_known_launcher)] = "none"
    engine: Annotated[str, flag("Engine of the workers it starts.", name="--worker-engine")] = "sim"
    model_dir: Annotated[str, flag("Model directory of the workers it starts.", name="--worker-model-dir")] = ""
    log_dir: Annotated[str, flag("Log directory of the workers it starts.", name="--worker-log-dir")] = ".tandem/logs"
    # further `tandem worker` flags, given as they are
    worker_args: Annotated[tuple[str, ...], flag("Further `tandem worker` flags for the workers it starts.",
                                                 option_type=str, default="", parse=_split_args,
                                                 render=shlex.join)] = ()
    start_timeout_s: float = 60.0
    docker: DockerLauncherConfig = DockerLauncherConfig()

    def validate(self) -> None:
        require(self.kind in LAUNCHERS, f"launcher {self.kind!r} must be none, local or docker")
        require(self.kind == "none" or bool(self.model_dir), f"the {self.kind} launcher needs a model directory")
        require(self.start_timeout_s > 0, "the worker start timeout must be positive")
        if self.kind == "docker":
            self.docker.validate()


class ScaleToZeroConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Models that may have no worker (`shared.scalable_models`): a router holding their requests
    asks for workers (`WakeModel`), which the launcher starts with the model's directory (one of
    role both, or the prefill and decode workers of its `@<P>p<D>d` shape); with `idle_s`, a
    model's launched workers are drained and stopped once no request reached it that long."""

    models: Annotated[tuple[str, ...], flag(
        "A model that may have zero workers, NAME=DIR or NAME=DIR@1p1d (repeat): a router holding its requests "
        "gets a worker of role both started through the launcher, or with @<P>p<D>d that many prefill and decode "
        "workers.", name="--scalable-model")] = ()
    idle_s: Annotated[float, flag(
        "Drain and stop a scalable model's launched workers once it had no request this long (0: never).",
        name="--scale-to-zero-after")] = 0.0
    interval_s: float = 1.0  # how often idle models are looked for
    drain_deadline_s: float = 30.0  # a scale-down's drain

    def scalable(self) -> dict[str, ScalableModel]:
        """Each scalable model, by name."""
        return scalable_models(self.models)

    def validate(self) -> None:
        self.scalable()
        require(self.idle_s >= 0, "the scale-to-zero idle time must not be negative")
        require(self.interval_s > 0 and self.drain_deadline_s > 0, "scale-to-zero interval and drain must be positive")


class PlannerLoopConfig(msgspec.Struct, kw_only=True, frozen=True):
    """The SLO planner inside the orchestrator: every `interval_s` it reads the cluster over
    the last `window_s` and may switch a worker's role, add or remove one (dry run: only
    publishes what it would do)."""

    enabled: Annotated[bool, flag("Run the SLO planner (role switches, add, remove).", name="--planner")] = False
    dry_run: Annotated[bool, flag("Publish the planner's decisions, carry none out.", name="--planner-dry-run")] = \
        False
    interval_s: Annotated[float, flag("Seconds between planner ticks.", name="--planner-interval")] = 2.0
    # request records and load snapshots this far back
    window_s: Annotated[float, flag("Seconds of records and load the planner reads.", name="--planner-window")] = 30.0
    ttft_p90_ms: Annotated[float, flag("Planner SLO: TTFT p90 (ms).")] = 2000.0
    itl_p90_ms: Annotated[float, flag("Planner SLO: inter-token latency p90 (ms).")] = 100.0
    # a signal held this long before an action
    sustain_s: Annotated[float, flag("Seconds a signal holds before the planner acts.", name="--planner-sustain")] = \
        30.0
    global_cooldown_s: Annotated[float, flag("Seconds after any planner action before the next.",
                                             name="--planner-cooldown")] = 60.0
    worker_cooldown_s: float = 300.0
    operator_hold_s: float = 600.0  # a worker an operator command touched is left alone this long
    prefill_capacity_tok_s: float = 0.0  # per prefill worker; 0: unknown (the demand term is left out)
    # the planner's budget: prefill + decode workers in all
    max_workers: Annotated[int, flag("Planner budget: prefill + decode workers.", name="--planner-max-workers")] = 8
    drain_deadline_s: float = 30.0  # a scale-down's drain

    def validate(self) -> None:
        require(self.interval_s > 0 and self.window_s > 0, "planner interval and window must be positive")
        require(self.ttft_p90_ms > 0 and self.itl_p90_ms > 0, "planner SLOs must be positive")
        require(min(self.sustain_s, self.global_cooldown_s, self.worker_cooldown_s, self.operator_hold_s,
                    self.prefill_capacity_tok_s) >= 0, "planner durations must not be negative")
        require(self.max_workers >= 2 and self.drain_deadline_s > 0, "planner budget needs 2+ workers")


class OrchestratorConfig(msgspec.Struct, kw_only=True, frozen=True):
    bus: BusConfig = BusConfig()
    membership: MembershipConfig = MembershipConfig()
    sweep_interval_s: float = 0.25
    launcher: WorkerLauncherConfig = WorkerLauncherConfig()
    limits: WorkerLimits = WorkerLimits()
    # how long a command waits for the worker's answer to show
    command_timeout_s: Annotated[float, flag("Seconds a command waits for a worker's answer.",
                                             name="--command-timeout")] = 10.0
    planner: PlannerLoopConfig = PlannerLoopConfig()
    scale_to_zero: ScaleToZeroConfig = ScaleToZeroConfig()
    tracing: TracingConfig = TracingConfig()

    def validate(self) -> None:
        require(self.sweep_interval_s > 0, "sweep interval must be positive")
        require(self.command_timeout_s > 0, "the command timeout must be positive")
        self.membership.validate()
        self.limits.validate()
        self.launcher.validate()
        self.planner.validate()
        self.scale_to_zero.validate()
        require(not self.scale_to_zero.models or self.launcher.kind != "none",
                "scalable models need a worker launcher (--launcher local or docker)")
