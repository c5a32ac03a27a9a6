"""What every launcher writes (`launch.argv` for `tandem up`, `launch.compose` and `launch.k8s`
for containers, the orchestrator's `worker_command` for `tandem ctl add` and scale-from-zero)
parses through the real `tandem <service>` commands into the settings the launcher meant: a
renamed flag or field fails here, not in a launched process."""

from __future__ import annotations

import msgspec
import pytest

from launch.argv import metrics_args, orchestrator_args, router_args, worker_args
from launch.compose import compose_document
from launch.definition import default_definition_path, load_definition
from launch.k8s import k8s_documents
from launch.plan import plan_stack
from services.orchestrator.config import OrchestratorConfig, WorkerLauncherConfig
from services.orchestrator.launchers.base import WorkerLaunch
from services.orchestrator.launchers.worker_command import model_flags, worker_command
from shared.config import BusConfig, MembershipConfig
from shared.schemas import WorkerRole
from tests.unit.service_command_parsing import clear_flag_environment, config_of


def own(config):
    """A service's own config: a worker command's worker part (beside its engines' options)."""
    return getattr(config, "worker", config)


@pytest.fixture(autouse=True)
def _no_flag_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_flag_environment(monkeypatch)


@pytest.fixture(scope="module")
def definition():
    settings = {"kv_lease_ttl": 4, "kv_transfer": False, "vllm_eager": True}
    packaged = load_definition(default_definition_path())
    groups = tuple(msgspec.structs.replace(group, settings={**group.settings, **settings})
                   for group in packaged.workers)
    return msgspec.structs.replace(packaged, model_dir="/models/m", workers=groups)


def test_the_local_stack_s_commands(definition) -> None:
    stack = msgspec.structs.replace(plan_stack(definition, log_dir="/logs"), scalable_models={"b": "/models/b"})
    spec = stack.workers[0]
    command = config_of(worker_args(stack, "nats://n:4", spec, restarts=2, last_exit="exit 1"))
    worker = command.worker
    assert command.vllm.enforce_eager and command.engine_config() == command.sim  # an engine's option by name
    assert (worker.worker_id, worker.role, worker.model_dir, worker.bus.nats_url) == (
        spec.worker_id, spec.role, "/models/m", "nats://n:4")
    assert (worker.kv_transfer.lease_ttl_s, worker.kv_transfer.enabled, worker.restarts) == (4.0, False, 2)
    router = config_of(router_args(stack, "nats://n:4", 8123, instance_port=8200))
    assert (router.port, router.model_dir, router.reuse_port, router.instance_port) == (8123, "/models/m", True, 8200)
    assert router.scale_from_zero.models == ("b=/models/b",)
    assert config_of(orchestrator_args(stack, "nats://n:4")).scale_to_zero.models == ("b=/models/b",)
    assert config_of(metrics_args(stack, "nats://n:4", 9111)).port == 9111


def test_the_compose_and_kubernetes_commands(definition) -> None:
    services = compose_document(definition, docker_launcher=True)["services"]
    for name in ("metrics", "router", "prefill", "decode"):
        config = config_of(services[name]["command"])
        assert own(config).bus.nats_url == "nats://nats:4222"
    assert config_of(services["decode"]["command"]).worker.slots.directory
    orchestrator = config_of(services["orchestrator"]["command"])
    assert (orchestrator.launcher.kind, orchestrator.launcher.model_dir) == ("docker", "/models/m")
    launched = config_of(["worker", *orchestrator.launcher.worker_args])  # its --worker-args parse as flags
    assert launched.worker.kv_transfer.lease_ttl_s == 4.0
    for document in k8s_documents(definition):
        if document["kind"] == "Deployment" and document["metadata"]["name"] != "tandem-nats":
            args = document["spec"]["template"]["spec"]["containers"][0]["args"]
            assert own(config_of(args)).bus.namespace == definition.namespace


def test_the_orchestrator_s_worker_command() -> None:
    config = OrchestratorConfig(bus=BusConfig(nats_url="nats://n:4", namespace="ns", replicas=3),
                                membership=MembershipConfig(heartbeat_interval_s=0.2, ttl_s=1.0),
                                launcher=WorkerLauncherConfig(kind="local", model_dir="/models/m", engine="sim",
                                                              worker_args=("--kv-blocks", "128")))
    extra = model_flags("/models/b", "b")
    worker = config_of(worker_command(config, WorkerLaunch(worker_id="w-1", role=WorkerRole.DECODE,
                                                           extra_args=extra))).worker
    assert (worker.worker_id, worker.role, worker.bus.replicas, worker.membership.ttl_s) == (
        "w-1", WorkerRole.DECODE, 3, 1.0)
    assert (worker.model_dir, worker.served_model_name, worker.kv_blocks) == ("/models/b", "b", 128)
