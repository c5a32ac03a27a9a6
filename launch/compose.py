"""The stack definition rendered as a Docker Compose file (`compose/docker-compose.yml`).

`tandem up` and `docker compose up` run the same stack: both come from one
`StackDefinition` (`launch/stacks/local.toml`). `compose_document(definition)` gives the
compose file as plain data; `render_compose(definition)` as YAML text, which
`tandem compose render` prints and a test compares with the checked-in file. Pure: no I/O.

What the definition gives: services, their settings (as command-line options), ports, the
namespace, membership timing, dependencies and worker groups (`count` -> replicas). What
the deployment adds: images and build targets, one set of worker services per engine
profile (`sim`, the default through compose/.env; `vllm-cpu`; `vllm-gpu` with the NVIDIA
device reservation), an embedded NATS, a one-shot service writing the tiny model into a
volume, a one-shot `secrets` service making the router's API key and the NATS users, TLS
and server configuration in the `secrets` volume (`launch.compose_secrets`; every service
mounts it read-only and gets its files' paths in `TANDEM_*` variables), health checks (the router's readiness `/ready`), drain on stop, and the
`observability` profile (`launch.compose_observability`). Workers join by themselves: the
secrets service makes N worker slots (`TANDEM_WORKER_SLOTS`, default `render_compose`'s
`worker_slots`), a worker id and NATS user each, and every worker replica claims a free one
in the shared `slots` volume (`shared.worker_slots`), so `--scale decode=3` just works while
slots last and no worker holds credentials that act for another.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from launch.compose_args import ContainerArgs, slot_flags
from launch.compose_launcher import with_docker_launcher
from launch.compose_observability import OTLP_TRACES_ENDPOINT, observability_services
from launch.compose_secrets import (
    DEFAULT_WORKER_SLOTS,
    SECRETS_DIR,
    SLOTS_DIR,
    api_keys_env,
    nats_dir_path,
    nats_env,
    server_config_path,
)
from launch.compose_yaml import to_yaml
from launch.definition import METRICS, NATS, ORCHESTRATOR, ROUTER, StackDefinition, WorkerGroup, checked
from launch.service_commands import WORKER_COMMAND
from services.worker.engines import engine_spec
from shared.config import WorkerSlotsConfig

MODEL_VOLUME, NATS_VOLUME, SECRETS_VOLUME = "models", "nats-data", "secrets"
SLOTS_VOLUME = "slots"  # the worker slots' lock files: written by the workers, so not in secrets
WORKER_SLOTS_VAR = "TANDEM_WORKER_SLOTS"
TINY_MODEL_DIR = "/models/tiny"
NATS_PORT, NATS_MONITOR_PORT = 4222, 8222
ROUTER_READY = "/ready"  # compose health checks mean readiness; the definition's `health` is liveness
MODEL_SERVICE = "model"
SECRETS_SERVICE = "secrets"
WORKER_GRACE = "60s"  # SIGTERM: the worker drains its in-flight requests, then exits


@dataclass(frozen=True)
class EngineProfile:
    """One way to run the workers: a compose profile, the image's build target, the engine."""

    profile: str
    target: str
    image: str  # a compose variable expression
    engine: str = ""  # empty: each group's own engine
    base_image: str = "${TANDEM_BASE_IMAGE:-python:3.11-slim}"
    build_args: tuple[tuple[str, str], ...] = ()
    gpu: bool = False
    stop_grace: str = WORKER_GRACE
    suffix: str = ""  # appended to each worker group's service name


TANDEM = EngineProfile("sim", "tandem", "${TANDEM_IMAGE:-tandem:latest}")
ENGINE_PROFILES = (
    TANDEM,
    EngineProfile("vllm-cpu", "vllm-cpu", "${TANDEM_VLLM_CPU_IMAGE:-tandem-vllm-cpu:latest}", engine="vllm",
                  build_args=(("TORCH_INDEX", "${TORCH_INDEX-https://download.pytorch.org/whl/cpu}"),),
                  stop_grace="180s", suffix="-vllm-cpu"),
    EngineProfile("vllm-gpu", "vllm-gpu", "${TANDEM_VLLM_GPU_IMAGE:-tandem-vllm-gpu:latest}", engine="vllm",
                  base_image="${TANDEM_CUDA_BASE_IMAGE:-nvidia/cuda:12.8.1-runtime-ubuntu24.04}",
                  gpu=True, stop_grace="180s", suffix="-vllm-gpu"),
)

HEADER = """\
# Generated from launch/stacks/local.toml by `tandem compose render`: do not edit by hand
# (`make compose-render` rewrites it; a test checks it matches the definition).
#
# From this directory (its .env sets the default profile, sim, and the project name):
#   docker compose up -d
#   docker compose up -d --scale decode=2
#   docker compose --profile vllm-cpu up -d
#   TANDEM_TRACE_EXPORTER=otlp docker compose --profile sim --profile observability up -d
#
# Secure by default: the router wants an API key, made on the first start in the secrets
# volume (read it: docker compose exec router cat /secrets/api-key); NATS takes only the
# services' users, over TLS with client certificates (files in the same volume). Each worker
# claims one of TANDEM_WORKER_SLOTS worker slots, a NATS user each (default below, in the
# secrets service's command); more workers than slots: raise it and recreate the stack,
#   TANDEM_WORKER_SLOTS=16 docker compose up -d --force-recreate
#
# Variables: PORT (router, 8000), METRICS_PORT (9100), TANDEM_BASE_IMAGE, TANDEM_IMAGE,
# TANDEM_VLLM_CPU_IMAGE, TANDEM_VLLM_GPU_IMAGE, TANDEM_CUDA_BASE_IMAGE, TANDEM_NATS_IMAGE,
# TORCH_INDEX, TANDEM_TRACE_EXPORTER (none | otlp), TANDEM_LOG_LEVEL; the observability
# profile's: JAEGER_PORT, PROMETHEUS_PORT, GRAFANA_PORT and their images (see below).
"""


def render_compose(definition: StackDefinition, *, worker_slots: int = DEFAULT_WORKER_SLOTS,
                   docker_launcher: bool = False) -> str:
    """The compose file's text for `definition` (`worker_slots`: unless TANDEM_WORKER_SLOTS says)."""
    return HEADER + to_yaml(compose_document(definition, worker_slots=worker_slots, docker_launcher=docker_launcher))


def compose_document(definition: StackDefinition, *, worker_slots: int = DEFAULT_WORKER_SLOTS,
                     docker_launcher: bool = False) -> dict[str, object]:
    """The compose file as data: services and volumes. `docker_launcher`: the orchestrator
    starts workers for `tandem ctl add` as containers (`launch.compose_launcher`; it mounts
    the Docker socket)."""
    definition = checked(definition, definition.name)
    nats_url = definition.nats.url or f"nats://{NATS}:{NATS_PORT}"
    model_dir = definition.model_dir or TINY_MODEL_DIR
    services: dict[str, object] = {SECRETS_SERVICE: _secrets_service(definition, worker_slots)}
    if not definition.nats.url:
        services[NATS] = _nats()
    if not definition.model_dir:
        services[MODEL_SERVICE] = _model_service()
    args = ContainerArgs(definition, nats_url, model_dir)
    orchestrator = definition.orchestrator
    services[ORCHESTRATOR] = _tandem_service(TANDEM, definition, args.orchestrator(), orchestrator.depends_on,
                                             nats_user="orchestrator")
    metrics = definition.metrics
    services[METRICS] = _tandem_service(
        TANDEM, definition, args.metrics(), metrics.depends_on, nats_user="metrics",
        health_url=f"http://127.0.0.1:{metrics.port}{metrics.health}",
        ports=[f"${{METRICS_PORT:-{metrics.port}}}:{metrics.port}"])
    router = definition.router
    services[ROUTER] = _tandem_service(
        TANDEM, definition, args.router(), router.depends_on, nats_user="router",
        health_url=f"http://127.0.0.1:{router.port}{ROUTER_READY}",
        ports=[f"${{PORT:-{router.port}}}:{router.port}"], model=True, extra_env=api_keys_env())
    for profile in ENGINE_PROFILES:
        for group in definition.workers:
            if group.count > 0:
                services[group.name + profile.suffix] = _worker(profile, definition, group, args)
    services.update(observability_services())
    if docker_launcher:
        services[ORCHESTRATOR] = _orchestrator_with_docker_launcher(services[ORCHESTRATOR], definition, args)
    return {"services": services,
            "volumes": {MODEL_VOLUME: {}, NATS_VOLUME: {}, SECRETS_VOLUME: {}, SLOTS_VOLUME: {}}}


def _orchestrator_with_docker_launcher(orchestrator: object, definition: StackDefinition,
                                       args: ContainerArgs) -> dict[str, object]:
    """Its launched workers: like the first worker group's sim-profile service."""
    assert isinstance(orchestrator, dict) and definition.workers
    group = definition.workers[0]
    return with_docker_launcher(orchestrator, _worker(TANDEM, definition, group, args), engine=group.engine,
                                model_dir=args.model_dir,
                                worker_settings=[*WORKER_COMMAND.setting_flags(group.settings),
                                                 *slot_flags(_worker_slots(definition))])


def _worker_slots(definition: StackDefinition) -> WorkerSlotsConfig:
    """A worker's id and NATS user: a slot it claims when it starts (`shared.worker_slots`);
    a launched worker's `--worker-id` claims that very slot."""
    return WorkerSlotsConfig(directory=SLOTS_DIR, nats_dir="" if definition.nats.url else nats_dir_path())


def _secrets_service(definition: StackDefinition, worker_slots: int) -> dict[str, object]:
    """Makes the API key, the NATS files (a user per worker slot) in the secrets volume and
    the worker slots in theirs where missing, then exits; a later start keeps them (`tandem
    compose secrets`). Prints paths only."""
    if worker_slots < 1:
        raise ValueError("at least one worker slot is needed")
    service = _image(TANDEM)
    service.update({
        "command": ["compose", "secrets", SECRETS_DIR, "--namespace", definition.namespace, "--nats-host", NATS,
                    "--worker-slots", f"${{{WORKER_SLOTS_VAR}:-{worker_slots}}}", "--slots-dir", SLOTS_DIR],
        "volumes": [f"{SECRETS_VOLUME}:{SECRETS_DIR}", f"{SLOTS_VOLUME}:{SLOTS_DIR}"],
        "healthcheck": {"disable": True},
        "restart": "no",
    })
    return service


def _nats() -> dict[str, object]:
    """JetStream on, its store in a volume; users, permissions and TLS from the configuration
    the secrets service made. The official image by default; the Tandem image has nats-server
    too (TANDEM_NATS_IMAGE=tandem:latest), hence the two-way health check (on the monitoring
    port, which is not published)."""
    return {
        "image": "${TANDEM_NATS_IMAGE:-nats:2.10-alpine}",
        "entrypoint": ["nats-server"],
        "command": ["--config", server_config_path(), "--jetstream", "--store_dir", "/data",
                    "--port", str(NATS_PORT), "--http_port", str(NATS_MONITOR_PORT)],
        "environment": {"TANDEM_HEALTH_URL": f"http://127.0.0.1:{NATS_MONITOR_PORT}/healthz"},
        "volumes": [f"{NATS_VOLUME}:/data", f"{SECRETS_VOLUME}:{SECRETS_DIR}:ro"],
        "depends_on": {SECRETS_SERVICE: {"condition": "service_completed_successfully"}},
        "healthcheck": {"test": ["CMD-SHELL", "wget -q -O /dev/null \"$$TANDEM_HEALTH_URL\" || tandem-healthcheck"],
                        **_health_timing()},
        "restart": "unless-stopped",
    }


def _model_service() -> dict[str, object]:
    """Writes the tiny model into the models volume once; every other start finds it there."""
    service = _image(TANDEM)
    service.update({
        "entrypoint": ["sh", "-c", f'test -f {TINY_MODEL_DIR}/config.json || exec tandem model tiny {TINY_MODEL_DIR}'],
        "volumes": [f"{MODEL_VOLUME}:/models"],
        "healthcheck": {"disable": True},
        "restart": "no",
    })
    return service


def _worker(profile: EngineProfile, definition: StackDefinition, group: WorkerGroup,
            args: ContainerArgs) -> dict[str, object]:
    engine = profile.engine or group.engine
    # The worker id and NATS user: a slot each replica claims when it starts (`shared.worker_slots`).
    service = _tandem_service(profile, definition, args.worker(group, engine, slots=_worker_slots(definition)),
                              group.depends_on,
                              model=True, volumes=(f"{SLOTS_VOLUME}:{SLOTS_DIR}",))
    service["profiles"] = [profile.profile]
    service["stop_grace_period"] = profile.stop_grace
    deploy: dict[str, object] = {}
    if group.count != 1:
        service["deploy"] = deploy
        deploy["replicas"] = group.count
    shm_size = engine_spec(engine).deployment.shm_size
    if shm_size:
        service["shm_size"] = shm_size
    if profile.gpu:
        service["deploy"] = deploy
        deploy["resources"] = {
            "reservations": {"devices": [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]}}
    return service


def _tandem_service(profile: EngineProfile, definition: StackDefinition, command: list[str],
                    depends_on: tuple[str, ...], *, nats_user: str = "", health_url: str = "",
                    ports: list[str] | None = None, model: bool = False,
                    extra_env: Mapping[str, str] | None = None, volumes: tuple[str, ...] = ()) -> dict[str, object]:
    service = _image(profile)
    service["command"] = command
    environment = {"TANDEM_LOG_LEVEL": "${TANDEM_LOG_LEVEL:-info}",
                   "TANDEM_TRACE_EXPORTER": "${TANDEM_TRACE_EXPORTER:-none}",
                   "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": OTLP_TRACES_ENDPOINT}
    if nats_user and not definition.nats.url:  # the embedded NATS: this service's user, paths in the volume
        environment.update(nats_env(nats_user))
    environment.update(extra_env or {})
    if health_url:
        environment["TANDEM_HEALTH_URL"] = health_url
        service["healthcheck"] = {"test": ["CMD", "tandem-healthcheck"], **_health_timing()}
    service["environment"] = environment
    if ports:
        service["ports"] = ports
    service["volumes"] = [*([f"{MODEL_VOLUME}:/models:ro"] if model else []), f"{SECRETS_VOLUME}:{SECRETS_DIR}:ro",
                          *volumes]
    service["depends_on"] = _depends_on(definition, depends_on, model)
    service["init"] = True  # signals reach the service; its children are reaped
    service["restart"] = "on-failure"  # not after a drain's clean exit
    return service


def _image(profile: EngineProfile) -> dict[str, object]:
    args = {"BASE_IMAGE": profile.base_image, **dict(profile.build_args)}
    return {"image": profile.image,
            "build": {"context": "..", "dockerfile": "compose/Dockerfile", "target": profile.target, "args": args}}


def _depends_on(definition: StackDefinition, names: tuple[str, ...], model: bool) -> dict[str, object]:
    conditions: dict[str, object] = {}
    for name in names:
        if name == NATS and definition.nats.url:
            continue  # an external NATS is not a service here
        conditions[name] = {"condition": "service_healthy" if name in (NATS, METRICS, ROUTER) else "service_started"}
    if model and not definition.model_dir:
        conditions[MODEL_SERVICE] = {"condition": "service_completed_successfully"}
    conditions[SECRETS_SERVICE] = {"condition": "service_completed_successfully"}
    return conditions


def _health_timing() -> Mapping[str, object]:
    return {"interval": "2s", "timeout": "3s", "retries": 30, "start_period": "60s"}
