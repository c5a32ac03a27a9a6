"""The compose file is rendered from the stack definition (`launch.compose`): the checked-in
compose/docker-compose.yml is exactly `tandem compose render`'s output, and the rendering
keeps the definition's services, settings, ports and dependencies. Needs no Docker."""

from __future__ import annotations

import msgspec
import pytest

from launch.compose import ENGINE_PROFILES, compose_document, render_compose
from launch.compose_yaml import to_yaml
from launch.definition import default_definition_path, load_definition
from tests.compose.docker_stack import COMPOSE_FILE


@pytest.fixture
def definition():
    return load_definition(default_definition_path())


def test_checked_in_compose_file_is_the_rendered_definition(definition) -> None:
    assert COMPOSE_FILE.read_text() == render_compose(definition), \
        "compose/docker-compose.yml is stale: run `make compose-render`"


def test_services_profiles_and_settings_come_from_the_definition(definition) -> None:
    yaml = pytest.importorskip("yaml")  # PyYAML, when installed, reads the file back
    document = yaml.safe_load(render_compose(definition))
    assert document == compose_document(definition)  # the YAML writer loses nothing
    services = document["services"]
    assert {"nats", "model", "orchestrator", "metrics", "router", "prefill", "decode"} <= set(services)
    for profile in ENGINE_PROFILES:
        for group in ("prefill", "decode"):
            worker = services[group + profile.suffix]
            assert worker["profiles"] == [profile.profile]
            assert worker["command"][worker["command"].index("--role") + 1] == group
            assert "entrypoint" not in worker  # its id: the worker slot it claims, unique per replica
            assert "--sim-speedup" in worker["command"]  # the group's settings
    assert services["decode-vllm-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    router = services["router"]
    assert router["command"][router["command"].index("--routing-policy") + 1] == "kv-aware"
    assert router["ports"] == ["${PORT:-8000}:8000"] and router["environment"]["TANDEM_HEALTH_URL"].endswith("/ready")
    assert router["depends_on"]["nats"] == {"condition": "service_healthy"}
    assert {service for service, body in services.items() if body.get("profiles") == ["observability"]} == \
        {"otel-collector", "jaeger", "prometheus", "grafana"}


def test_counts_nats_and_model_directory_follow_the_definition(definition) -> None:
    replace = msgspec.structs.replace
    groups = tuple(replace(group, count=3) if group.name == "decode" else group for group in definition.workers)
    changed = replace(definition, workers=groups, nats=replace(definition.nats, url="nats://broker:4222"),
                      model_dir="/srv/model", namespace="blue")
    services = compose_document(changed)["services"]
    assert "nats" not in services and "model" not in services
    assert services["decode"]["deploy"] == {"replicas": 3} and "deploy" not in services["prefill"]
    assert "worker" not in services  # groups with count 0 are left out
    command = services["decode"]["command"]
    assert command[command.index("--nats-url") + 1] == "nats://broker:4222"
    assert command[command.index("--namespace") + 1] == "blue"
    assert command[command.index("--model-dir") + 1] == "/srv/model"
    assert "nats" not in services["decode"]["depends_on"]


def test_yaml_writer_quotes_every_string() -> None:
    text = to_yaml({"a": {"on": "yes", "list": ["8000:8000", 1, True], "empty": {}, "seq": [{"x": "1", "y": [2]}]}})
    assert text == ('a:\n  "on": "yes"\n  list: ["8000:8000", 1, true]\n  empty: {}\n'
                    '  seq:\n    - x: "1"\n      y: [2]\n')


def test_secure_by_default_with_paths_only(definition) -> None:
    """A one-shot `secrets` service first; every Tandem service mounts its volume read-only and
    gets file paths (its own NATS user), nothing else; the workers find theirs through the
    worker slot each claims (a NATS user per slot, none shared)."""
    services = compose_document(definition)["services"]
    secrets = services["secrets"]
    assert secrets["command"][:3] == ["compose", "secrets", "/secrets"] and secrets["restart"] == "no"
    assert secrets["command"][3:] == ["--namespace", "tandem", "--nats-host", "nats",
                                      "--worker-slots", "${TANDEM_WORKER_SLOTS:-8}", "--slots-dir", "/slots"]
    assert secrets["volumes"] == ["secrets:/secrets", "slots:/slots"]
    assert services["nats"]["command"][:2] == ["--config", "/secrets/nats/nats-server.conf"]
    assert "ports" not in services["nats"]
    for name in ("prefill", "decode", "decode-vllm-gpu", "prefill-vllm-cpu"):
        worker = services[name]
        assert worker["command"][-4:] == ["--worker-slots", "/slots", "--worker-slot-nats-dir", "/secrets/nats"]
        assert worker["volumes"][-2:] == ["secrets:/secrets:ro", "slots:/slots"]
        assert not [key for key in worker["environment"] if key.startswith("TANDEM_NATS_")]
        assert worker["depends_on"]["secrets"] == {"condition": "service_completed_successfully"}
    users = {"orchestrator": "orchestrator", "metrics": "metrics", "router": "router"}
    for name, user in users.items():
        service = services[name]
        assert "secrets:/secrets:ro" in service["volumes"]
        assert service["depends_on"]["secrets"] == {"condition": "service_completed_successfully"}
        environment = service["environment"]
        assert environment["TANDEM_NATS_CREDS_FILE"] == f"/secrets/nats/creds/{user}.creds"
        assert environment["TANDEM_NATS_KEY_FILE"] == f"/secrets/nats/tls/client-{user}-key.pem"
        assert all(not key.endswith(("PASSWORD", "_KEY", "TOKEN")) for key in environment)
    assert services["router"]["environment"]["TANDEM_API_KEYS_FILE"] == "/secrets/api-keys.jsonl"
    external = msgspec.structs.replace(definition, nats=msgspec.structs.replace(definition.nats, url="nats://b:4222"))
    assert not [key for key in compose_document(external)["services"]["router"]["environment"]
                if key.startswith("TANDEM_NATS_")]
    decode = compose_document(external)["services"]["decode"]  # slots for ids only: its NATS is not ours
    assert decode["command"][-2:] == ["--worker-slots", "/slots"]


def test_the_worker_slot_count_is_a_render_option_and_a_compose_variable(definition) -> None:
    command = compose_document(definition, worker_slots=16)["services"]["secrets"]["command"]
    assert command[command.index("--worker-slots") + 1] == "${TANDEM_WORKER_SLOTS:-16}"
    assert "TANDEM_WORKER_SLOTS=16 docker compose up -d --force-recreate" in render_compose(definition)
    assert compose_document(definition)["volumes"]["slots"] == {}
    with pytest.raises(ValueError):
        compose_document(definition, worker_slots=0)
