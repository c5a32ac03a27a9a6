"""The Kubernetes manifests rendered from the stack definition (`launch.k8s`): every object
passes strict validation against Kubernetes' OpenAPI schemas (`kubernetes-validate`, its
schemas bundled: no network), every reference inside the render resolves (Secrets, their
keys and the paths services read, ConfigMaps, claims, Services' selectors and ports), and the
definition's worker groups and settings are what runs. The NATS configuration and the
Secrets are checked for real: a nats-server runs with them and the services' files connect.
No cluster is involved."""

from __future__ import annotations

import base64
import copy
import json
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import kubernetes_validate
import msgspec
import pytest
import yaml

from launch.compose import compose_document
from launch.compose_secrets import API_KEYS_ENV
from launch.definition import DefinitionError, default_definition_path, load_definition
from launch.k8s import K8sOptions, k8s_documents, render_k8s
from launch.k8s_nats import CONFIG_FILE, server_config
from launch.k8s_objects import COMPONENT_LABEL, GROUP_LABEL, INSTANCE_LABEL, MANAGED_BY_LABEL, NAME_LABEL
from launch.k8s_secrets import NATS_SERVER_SECRET, make_secret_documents, user_files, write_secrets_file
from shared.bus import BusConnectError, connect
from shared.config import BusConfig
from shared.nats_security import ENV_CA_FILE, ENV_CERT_FILE, ENV_CREDS_FILE, ENV_KEY_FILE
from shared.nats_server import EmbeddedNats, find_binary
from tests.waiting import wait_for_sync

# The oldest Kubernetes still commonly run, and the newest the validator knows.
VERSIONS = ("1.29", kubernetes_validate.latest_version())
WORKLOADS = ("Deployment", "StatefulSet")
Document = dict


@pytest.fixture(scope="module")
def definition():
    return load_definition(default_definition_path())


@pytest.fixture(scope="module")
def secrets() -> list[Document]:
    return make_secret_documents(namespace="tandem", kube_namespace="tandem", instance="local",
                                 nats_service="tandem-nats")


def variants(definition) -> Iterator[tuple[str, list[Document]]]:
    """The default render and ones that take the other branches: vLLM on GPUs with a model
    volume and tracing; an external NATS."""
    replace = msgspec.structs.replace
    yield "default", k8s_documents(definition)
    yield "vllm", k8s_documents(replace(definition, model_dir="/models/llama"),
                                K8sOptions(engine="vllm", gpus_per_worker=1, worker_image="tandem-vllm-gpu:1",
                                           otlp_endpoint="http://otel-collector:4318/v1/traces"))
    yield "external-nats", k8s_documents(replace(definition, nats=replace(definition.nats, url="nats://bus:4222")))


def named(documents: list[Document], kind: str, name: str) -> Document:
    [document] = [d for d in documents if d["kind"] == kind and d["metadata"]["name"] == name]
    return document


def pod_specs(documents: list[Document]) -> Iterator[tuple[Document, dict]]:
    for document in documents:
        if document["kind"] in WORKLOADS:
            yield document, document["spec"]["template"]["spec"]


def containers(spec: dict) -> list[dict]:
    return [*spec.get("initContainers", []), *spec["containers"]]


# -- schemas -------------------------------------------------------------------------------


def test_every_document_validates_strictly(definition, secrets) -> None:
    """Unknown fields are rejected (the strict schemas), kinds must exist, types must match."""
    checked = 0
    for _, documents in variants(definition):
        for document in [*documents, *secrets]:
            for version in VERSIONS:
                kubernetes_validate.validate(document, version, strict=True)
                checked += 1
    assert checked > 40


def test_a_broken_manifest_fails_validation(definition) -> None:
    router = named(k8s_documents(definition), "Deployment", "tandem-router")
    misspelt = copy.deepcopy(router)
    misspelt["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {"httpGet": {"path": "/", "port": 1}}
    wrong_type = copy.deepcopy(router)
    wrong_type["spec"]["replicas"] = "one"
    no_image = copy.deepcopy(router)
    del no_image["spec"]["template"]["spec"]["containers"][0]["name"]
    for broken in (misspelt, wrong_type, no_image):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, VERSIONS[0], strict=True)
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate({**router, "kind": "Deploymnet"}, VERSIONS[0], strict=True)


def test_the_yaml_text_is_the_documents(definition) -> None:
    text = render_k8s(definition)
    assert [d for d in yaml.safe_load_all(text) if d] == k8s_documents(definition)


# -- what runs -----------------------------------------------------------------------------


def test_every_workload_has_probes_on_its_real_ports(definition) -> None:
    for _, documents in variants(definition):
        for document, spec in pod_specs(documents):
            for container in spec["containers"]:
                assert "readinessProbe" in container and "livenessProbe" in container, document["metadata"]["name"]
                ports = {port["name"] for port in container.get("ports", [])}
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    if "httpGet" in container.get(probe, {}):
                        assert container[probe]["httpGet"]["port"] in ports
    documents = k8s_documents(definition)
    router = named(documents, "Deployment", "tandem-router")["spec"]["template"]["spec"]["containers"][0]
    assert router["readinessProbe"]["httpGet"]["path"] == "/ready"  # a worker serves the model
    assert router["livenessProbe"]["httpGet"]["path"] == definition.router.health == "/health"
    metrics = named(documents, "Deployment", "tandem-metrics")["spec"]["template"]["spec"]["containers"][0]
    assert metrics["readinessProbe"]["httpGet"]["path"] == "/health"


def test_router_and_collector_answer_the_probed_paths() -> None:
    """The probed paths are routes the services serve (not guarded by API keys)."""
    from services.metrics.auth import OPEN_PATHS
    from services.router.http.auth.middleware import METRICS_PATH

    app_source = (Path(__file__).resolve().parents[2] / "services" / "router" / "http" / "app.py").read_text()
    assert '@router.get("/health")' in app_source and '@router.get("/ready")' in app_source
    assert "/health" in OPEN_PATHS and METRICS_PATH == "/metrics"


def test_worker_replicas_and_commands_follow_the_definition(definition) -> None:
    documents = k8s_documents(definition)
    for group in definition.workers:
        worker = named(documents, "Deployment", f"tandem-{group.name}")
        assert worker["spec"]["replicas"] == group.count
        args = worker["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--role") + 1] == group.role.value
        assert args[args.index("--worker-id") + 1] == "$(POD_NAME)"  # one id per replica
        assert "--sim-speedup" in args
    replace = msgspec.structs.replace
    groups = tuple(replace(g, count=3) if g.name == "decode" else g for g in definition.workers)
    scaled = k8s_documents(replace(definition, workers=groups))
    assert named(scaled, "Deployment", "tandem-decode")["spec"]["replicas"] == 3


def test_router_replicas_follow_the_definition(definition) -> None:
    assert named(k8s_documents(definition), "Deployment", "tandem-router")["spec"]["replicas"] == definition.routers
    two = k8s_documents(msgspec.structs.replace(definition, routers=2))
    assert named(two, "Deployment", "tandem-router")["spec"]["replicas"] == 2


def test_commands_are_the_compose_stacks(definition) -> None:
    """Both renderers build command lines with the same helper: only the NATS host and the
    worker id (compose: a worker slot) differ."""
    compose = compose_document(definition)["services"]
    documents = k8s_documents(definition)
    for name in ("orchestrator", "metrics", "router", "prefill", "decode"):
        args = named(documents, "Deployment", f"tandem-{name}")["spec"]["template"]["spec"]["containers"][0]["args"]
        args = [arg.replace("tandem-nats", "nats") for arg in args]
        if "--worker-id" in args:
            assert args[args.index("--worker-id") + 1] == "$(POD_NAME)"
            del args[args.index("--worker-id"):args.index("--worker-id") + 2]
        command = compose[name]["command"]
        assert args == (command[:command.index("--worker-slots")] if "--worker-slots" in command else command)


def test_vllm_option_gpus_model_volume_and_tracing(definition) -> None:
    documents = dict(variants(definition))["vllm"]
    decode = named(documents, "Deployment", "tandem-decode")["spec"]["template"]["spec"]
    container = decode["containers"][0]
    assert container["image"] == "tandem-vllm-gpu:1"
    assert container["args"][container["args"].index("--engine") + 1] == "vllm"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert decode["terminationGracePeriodSeconds"] == 180
    assert "initContainers" not in decode  # the model comes from its volume
    claim = named(documents, "PersistentVolumeClaim", "tandem-models")
    assert {"name": "model", "mountPath": "/models/llama", "readOnly": True} in container["volumeMounts"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["TANDEM_TRACE_EXPORTER"] == "otlp"
    orchestrator = named(documents, "Deployment", "tandem-orchestrator")["spec"]["template"]["spec"]["containers"][0]
    assert orchestrator["image"] == "tandem:latest"  # the vLLM image is the workers' only


def test_external_nats_has_no_nats_objects_and_keeps_the_api_keys(definition) -> None:
    documents = dict(variants(definition))["external-nats"]
    assert not [d for d in documents if d["metadata"]["labels"][COMPONENT_LABEL] == "nats"]
    router = named(documents, "Deployment", "tandem-router")["spec"]["template"]["spec"]["containers"][0]
    env = {item["name"] for item in router["env"]}
    assert API_KEYS_ENV in env and ENV_CREDS_FILE not in env
    assert router["args"][router["args"].index("--nats-url") + 1] == "nats://bus:4222"


def test_names_kubernetes_would_refuse_are_definition_errors(definition) -> None:
    replace = msgspec.structs.replace
    groups = (*definition.workers, replace(definition.workers[0], name="big_gpu", count=0))
    with pytest.raises(DefinitionError, match="'big_gpu' is not a Kubernetes name"):
        k8s_documents(replace(definition, workers=groups))
    with pytest.raises(DefinitionError, match="--kube-namespace 'Prod'"):
        k8s_documents(definition, K8sOptions(kube_namespace="Prod"))
    with pytest.raises(DefinitionError, match="--worker-image"):
        k8s_documents(definition, K8sOptions(engine="vllm"))


def test_cli_render_prints_the_render(tmp_path: Path, definition) -> None:
    from typer.testing import CliRunner

    from cli.main import app

    result = CliRunner().invoke(app, ["k8s", "render", "--image", "registry.example/tandem:1"])
    assert result.exit_code == 0, result.output
    assert result.output == render_k8s(definition, K8sOptions(image="registry.example/tandem:1"))
    output = tmp_path / "tandem.yaml"
    assert CliRunner().invoke(app, ["k8s", "render", "-o", str(output)]).exit_code == 0
    assert output.read_text() == render_k8s(definition)


# -- references and labels ------------------------------------------------------------------


def test_no_secret_in_the_main_manifest(definition) -> None:
    for _, documents in variants(definition):
        assert "Secret" not in {document["kind"] for document in documents}
        text = yaml.safe_dump_all(documents)
        assert "BEGIN" not in text and "$2b$" not in text and "password" not in text.lower()
        for _, spec in pod_specs(documents):
            for container in containers(spec):
                for item in container.get("env", []):
                    assert "secretKeyRef" not in item.get("valueFrom", {})  # files, never values
                    assert not item["name"].endswith(("PASSWORD", "TOKEN", "_KEY")), item["name"]


def _mounted_paths(spec: dict, container: dict) -> set[str]:
    """Every file path the container sees from its projected Secrets and ConfigMaps."""
    volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
    paths: set[str] = set()
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"], {})  # not there: a StatefulSet's claim
        for source in volume.get("projected", {}).get("sources", []):
            for item in next(iter(source.values()))["items"]:
                paths.add(f"{mount['mountPath']}/{item['path']}")
    return paths


def test_every_reference_resolves(definition, secrets) -> None:
    """Secrets (and their keys) from `tandem k8s secrets`, ConfigMaps (and keys), claims,
    Services, `$(VAR)` in arguments, and every file path in an environment variable."""
    secret_keys = {d["metadata"]["name"]: set(d["data"]) for d in secrets}
    for variant, documents in variants(definition):
        config_keys = {d["metadata"]["name"]: set(d["data"]) for d in documents if d["kind"] == "ConfigMap"}
        claims = {d["metadata"]["name"] for d in documents if d["kind"] == "PersistentVolumeClaim"}
        services = {d["metadata"]["name"] for d in documents if d["kind"] == "Service"}
        for document, spec in pod_specs(documents):
            if document["kind"] == "StatefulSet":
                assert document["spec"]["serviceName"] in services
                claims |= {claim["metadata"]["name"] for claim in document["spec"]["volumeClaimTemplates"]}
            for volume in spec.get("volumes", []):
                for source in volume.get("projected", {}).get("sources", []):
                    kind, ref = next(iter(source.items()))
                    known = secret_keys if kind == "secret" else config_keys
                    assert ref["name"] in known, (variant, ref["name"])
                    assert {item["key"] for item in ref["items"]} <= known[ref["name"]]
                if "persistentVolumeClaim" in volume:
                    assert volume["persistentVolumeClaim"]["claimName"] in claims
            volume_names = {volume["name"] for volume in spec.get("volumes", [])}
            for container in containers(spec):
                assert {mount["name"] for mount in container.get("volumeMounts", [])} <= volume_names | claims
                env = {item["name"]: item.get("value", "") for item in container.get("env", [])}
                for arg in container.get("args", []):
                    if arg.startswith("$("):
                        assert arg[2:-1] in env
                files = _mounted_paths(spec, container)
                for name, value in env.items():
                    if name.endswith("_FILE"):
                        assert value in files, (variant, document["metadata"]["name"], name, value)
    nats_config = named(k8s_documents(definition), "StatefulSet", "tandem-nats")
    mounts = _mounted_paths(nats_config["spec"]["template"]["spec"],
                            nats_config["spec"]["template"]["spec"]["containers"][0])
    config = server_config("/etc/nats")
    for line in config.splitlines():  # every file the server configuration names is mounted
        if line.strip().startswith(("cert_file", "key_file", "ca_file")):
            assert line.split('"')[1] in mounts
    assert "/etc/nats/authorization.conf" in mounts and f"/etc/nats/{CONFIG_FILE}" in mounts


def test_services_select_pods_and_ports(definition) -> None:
    for _, documents in variants(definition):
        for svc in (d for d in documents if d["kind"] == "Service"):
            selector = svc["spec"]["selector"].items()
            matched = [spec for document, spec in pod_specs(documents)
                       if selector <= document["spec"]["template"]["metadata"]["labels"].items()]
            assert len(matched) == 1, svc["metadata"]["name"]
            port_names = {port["name"] for port in matched[0]["containers"][0]["ports"]}
            assert {port["targetPort"] for port in svc["spec"]["ports"]} <= port_names


def test_labels_are_consistent(definition) -> None:
    for _, documents in variants(definition):
        for document in documents:
            object_labels = document["metadata"]["labels"]
            assert object_labels[NAME_LABEL] == "tandem" and object_labels[INSTANCE_LABEL] == definition.name
            assert object_labels[MANAGED_BY_LABEL] == "tandem" and COMPONENT_LABEL in object_labels
            assert document["metadata"]["namespace"] == "tandem"
        for document, _ in pod_specs(documents):
            selector = document["spec"]["selector"]["matchLabels"].items()
            assert selector <= document["spec"]["template"]["metadata"]["labels"].items()
            assert selector <= document["metadata"]["labels"].items()
        selectors = [tuple(sorted(d["spec"]["selector"]["matchLabels"].items())) for d, _ in pod_specs(documents)]
        assert len(selectors) == len(set(selectors))  # no workload adopts another's pods
        workers = [d for d, _ in pod_specs(documents) if d["metadata"]["labels"][COMPONENT_LABEL] == "worker"]
        assert all(GROUP_LABEL in d["spec"]["selector"]["matchLabels"] for d in workers)


# -- the secrets, for real ----------------------------------------------------------------


def test_secrets_file_is_private_and_never_replaced(tmp_path: Path, secrets) -> None:
    path = write_secrets_file(tmp_path / "secrets.yaml", yaml.safe_dump_all(secrets))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(FileExistsError):
        write_secrets_file(path, "")
    api_key = base64.b64decode(named(secrets, "Secret", "tandem-api-key")["data"]["api-key"]).decode().strip()
    keys = base64.b64decode(named(secrets, "Secret", "tandem-api-keys")["data"]["api-keys.jsonl"]).decode()
    assert api_key and api_key not in keys  # the router's file holds hashes only


def test_cli_writes_secrets_and_prints_no_secret(tmp_path: Path) -> None:
    output = tmp_path / "secrets.yaml"
    command = [str(Path(sys.executable).parent / "tandem"), "k8s", "secrets", "-o", str(output)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    written = list(yaml.safe_load_all(output.read_text()))
    api_key = base64.b64decode(named(written, "Secret", "tandem-api-key")["data"]["api-key"]).decode().strip()
    assert api_key not in done.stdout + done.stderr
    again = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "exists" in again.stderr


def _write_secret(secret: Document, directory: Path, paths: dict[str, str] | None = None) -> None:
    for key, value in secret["data"].items():
        path = directory / (paths or {}).get(key, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(value))


@contextmanager
def nats_server_with(config_file: Path, work_dir: Path) -> Iterator[str]:
    """nats-server run with `config_file` as the pod runs it, but on loopback and free ports
    (flags win over the file); yields its TLS URL."""
    ports_dir = work_dir / "ports"
    ports_dir.mkdir()
    process = subprocess.Popen([find_binary(), "--config", str(config_file), "-a", "127.0.0.1", "-p", "-1",
                                "-m", "-1", "--ports_file_dir", str(ports_dir)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def reported() -> bool:
            assert process.poll() is None, process.stderr.read().decode() if process.stderr else "exited"
            try:
                return any("nats" in json.loads(path.read_text()) for path in ports_dir.glob("*.ports"))
            except json.JSONDecodeError:
                return False  # written but not complete yet

        wait_for_sync(reported, 10, "nats-server's ports file")
        [ports_file] = ports_dir.glob("*.ports")
        yield "tls://127.0.0.1:" + json.loads(ports_file.read_text())["nats"][0].rsplit(":", 1)[1]
    finally:
        process.terminate()
        process.wait(10)
        if process.stderr:
            process.stderr.close()


async def test_nats_runs_with_the_rendered_config_and_services_connect(tmp_path: Path, secrets) -> None:
    """The ConfigMap's nats.conf beside the server Secret's files, as the pod mounts them,
    starts a real nats-server with JetStream; each service's files (mounted as in its pod)
    connect over TLS with its user; another deployment's files are refused."""
    config_dir = tmp_path / "etc-nats"
    _write_secret(named(secrets, "Secret", NATS_SERVER_SECRET), config_dir)
    (config_dir / CONFIG_FILE).write_text(server_config(str(config_dir), str(tmp_path / "data")))
    with nats_server_with(config_dir / CONFIG_FILE, tmp_path) as url:
        for user in ("router", "worker", "orchestrator", "metrics", "operator"):
            mount = tmp_path / f"secrets-{user}"
            _write_secret(named(secrets, "Secret", f"tandem-nats-{user}"), mount, user_files(user))
            bus = await connect(_bus_config(url, mount, user), f"k8s-{user}")
            await bus.client.flush()
            await bus.close()
        other = make_secret_documents(namespace="tandem", kube_namespace="tandem", instance="local",
                                      nats_service="tandem-nats")
        stranger = tmp_path / "stranger"
        _write_secret(named(other, "Secret", "tandem-nats-router"), stranger, user_files("router"))
        with pytest.raises(BusConnectError):
            await connect(_bus_config(url, stranger, "router"), "k8s-stranger", connect_timeout_s=3)
    assert (tmp_path / "data" / "jetstream").is_dir()  # JetStream's store where the volume is


def _bus_config(url: str, mount: Path, user: str) -> BusConfig:
    from launch.compose_secrets import nats_env

    env = nats_env(user, str(mount))
    return BusConfig(nats_url=url, namespace="tandem", creds_file=env[ENV_CREDS_FILE], tls_ca_file=env[ENV_CA_FILE],
                     tls_cert_file=env[ENV_CERT_FILE], tls_key_file=env[ENV_KEY_FILE])


def test_nats_connection_probe_sees_an_established_connection(definition) -> None:
    """The orchestrator's and workers' probe command, run here against a real connection."""
    server = EmbeddedNats().start()
    try:
        probe = named(k8s_documents(definition), "Deployment", "tandem-decode")
        command = probe["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["exec"]["command"]
        command = [part.replace(":107E ", f":{server.port:04X} ") for part in command]
        assert ":107E " in probe["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["exec"]["command"][2]
        assert subprocess.run(command, timeout=10).returncode != 0  # nothing connected to it
        with socket.create_connection(("127.0.0.1", server.port), timeout=5):
            assert subprocess.run(command, timeout=10).returncode == 0
    finally:
        server.stop()
