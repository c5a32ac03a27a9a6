"""The Kubernetes render's pods, run as local processes: no cluster, but each container's own
arguments, environment, init container and mounted files, taken from the manifests and the
Secrets `tandem k8s secrets` makes.

Each pod gets a directory standing for its file system: its projected Secrets and ConfigMaps
written where the pod mounts them, its init container run first (the tiny model). Only what a
cluster provides is swapped: the NATS Service's name for a loopback address, fixed ports for
free ones, `$(POD_NAME)` for a pod name. Then the stack must serve a chat completion with the
API key from the Secret and refuse one without, every worker must register under its pod
name, and the probes must pass: HTTP paths on the router and collector, the NATS-connection
command of the others.
"""

from __future__ import annotations

import base64
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from launch.compose_secrets import nats_env
from launch.definition import default_definition_path, load_definition
from launch.k8s import k8s_documents
from launch.k8s_nats import CONFIG_FILE, NATS_PORT
from launch.k8s_secrets import make_secret_documents, user_files
from launch.process import LocalLauncher
from launch.readiness import reserve_port, wait_http_ok, wait_registered
from shared.config import BusConfig
from shared.nats_security import ENV_CA_FILE, ENV_CERT_FILE, ENV_CREDS_FILE, ENV_KEY_FILE
from tests.unit.test_k8s_manifests import named, nats_server_with

pytestmark = pytest.mark.e2e

Document = dict


class PodFiles:
    """A pod's file system: mount paths become directories under `root`."""

    def __init__(self, root: Path, spec: dict, container: dict, config_maps: list[Document],
                 secrets: list[Document]) -> None:
        self.root = root
        self.mounts = {mount["mountPath"]: mount["name"] for mount in container.get("volumeMounts", [])}
        volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
        sources = {"configMap": config_maps, "secret": secrets}
        for mount_path, name in self.mounts.items():
            (root / mount_path.lstrip("/")).mkdir(parents=True, exist_ok=True)
            for source in volumes.get(name, {}).get("projected", {}).get("sources", []):  # else: a claim
                kind, ref = next(iter(source.items()))
                [document] = [d for d in sources[kind] if d["metadata"]["name"] == ref["name"]]
                for item in ref["items"]:
                    value = document["data"][item["key"]]
                    path = root / mount_path.lstrip("/") / item["path"]
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(base64.b64decode(value) if kind == "secret" else value.encode())

    def path(self, value: str) -> str:
        """`value` with a mounted path moved under the pod's root."""
        for mount_path in sorted(self.mounts, key=len, reverse=True):
            if value == mount_path or value.startswith(mount_path + "/"):
                return str(self.root / value.lstrip("/"))
        return value


def pod_args(args: list[str], files: PodFiles, swaps: dict[str, str]) -> list[str]:
    result = []
    for arg in args:
        for old, new in swaps.items():
            arg = arg.replace(old, new)
        result.append(files.path(arg))
    return result


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("k8s-pods")
    definition = load_definition(default_definition_path())
    documents = k8s_documents(definition)
    secrets = make_secret_documents(namespace=definition.namespace, kube_namespace="tandem",
                                    instance=definition.name, nats_service="tandem-nats")
    config_maps = [d for d in documents if d["kind"] == "ConfigMap"]
    nats_set = named(documents, "StatefulSet", "tandem-nats")["spec"]["template"]["spec"]
    nats_files = PodFiles(root / "tandem-nats-0", nats_set, nats_set["containers"][0], config_maps, secrets)
    config = Path(nats_files.path(f"/etc/nats/{CONFIG_FILE}"))
    # The pod's paths in the configuration (TLS files, JetStream's store) moved under its root.
    config.write_text(config.read_text().replace('"/etc/nats/', f'"{root}/tandem-nats-0/etc/nats/')
                      .replace('"/data"', f'"{root}/tandem-nats-0/data"'))
    launcher = LocalLauncher(root / "logs")
    with nats_server_with(config, root / "tandem-nats-0") as nats_url:
        held = {component: reserve_port("127.0.0.1") for component in ("router", "metrics")}  # until the router answers
        ports = {component: sock.getsockname()[1] for component, sock in held.items()}
        nats_url = nats_url.replace("tls://", "nats://")  # as the services are given it: TLS from the CA file
        swaps = {f"nats://tandem-nats:{NATS_PORT}": nats_url}
        started: dict[str, dict] = {}
        workers = {}
        try:
            for document in documents:
                if document["kind"] != "Deployment":
                    continue
                spec = document["spec"]["template"]["spec"]
                for replica in range(document["spec"]["replicas"]):
                    pod_name = f"{document['metadata']['name']}-{replica}"
                    container = spec["containers"][0]
                    files = PodFiles(root / pod_name, spec, container, config_maps, secrets)
                    for init in spec.get("initContainers", []):  # the tiny model, made by the pod itself
                        done = subprocess.run([str(Path(sys.executable).parent / "tandem"),
                                               *pod_args(init["args"], files, {})], capture_output=True, timeout=120)
                        assert done.returncode == 0, done.stderr
                    env = {item["name"]: files.path(item["value"]) for item in container["env"] if "value" in item}
                    args = pod_args(container["args"], files, {**swaps, "$(POD_NAME)": pod_name})
                    component = container["name"]
                    if component in ports:
                        at = args.index("--port") + 1
                        args[at] = str(ports[component])
                        args[args.index("--host") + 1] = "127.0.0.1"
                    process = launcher.start(pod_name, args, env)
                    started[pod_name] = {"container": container, "files": files, "component": component}
                    if component == "worker":
                        workers[pod_name] = process
            operator = nats_env("operator", str(root / "operator"))  # the operator's files, as docs/kubernetes.md
            for key, path in user_files("operator").items():
                target = root / "operator" / path
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(base64.b64decode(named(secrets, "Secret", "tandem-nats-operator")["data"][key]))
            bus = BusConfig(nats_url=nats_url, namespace=definition.namespace, creds_file=operator[ENV_CREDS_FILE],
                            tls_ca_file=operator[ENV_CA_FILE], tls_cert_file=operator[ENV_CERT_FILE],
                            tls_key_file=operator[ENV_KEY_FILE])
            wait_registered(bus, definition.namespace, workers, timeout_s=60)
            router = launcher.processes["tandem-router-0"]
            wait_http_ok(router, f"http://127.0.0.1:{ports['router']}/ready", timeout_s=60)
            for sock in held.values():
                sock.close()
            api_key = base64.b64decode(named(secrets, "Secret", "tandem-api-key")["data"]["api-key"]).decode()
            yield {"launcher": launcher, "ports": ports, "started": started, "api_key": api_key.strip(),
                   "nats_port": int(nats_url.rsplit(":", 1)[1])}
        finally:
            for sock in held.values():
                sock.close()
            launcher.stop_all(timeout_s=20)


async def test_the_pods_serve_with_the_secrets_api_key(pods: dict) -> None:
    base = f"http://127.0.0.1:{pods['ports']['router']}/v1"
    client = openai.AsyncOpenAI(base_url=base, api_key=pods["api_key"], max_retries=0)
    model = (await client.models.list()).data[0].id
    reply = await client.chat.completions.create(model=model, max_tokens=8,
                                                 messages=[{"role": "user", "content": "Hello"}])
    assert reply.choices[0].message.content
    stranger = openai.AsyncOpenAI(base_url=base, api_key="not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await stranger.models.list()
    await client.close()
    await stranger.close()


def test_the_probes_pass(pods: dict) -> None:
    with httpx.Client(timeout=5) as http:
        for pod in pods["started"].values():
            container = pod["container"]
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                check = container.get(probe)
                if check is None:
                    continue
                if "httpGet" in check:
                    port = pods["ports"][pod["component"]]
                    assert http.get(f"http://127.0.0.1:{port}{check['httpGet']['path']}").status_code == 200
                else:
                    command = [part.replace(f":{NATS_PORT:04X} ", f":{pods['nats_port']:04X} ")
                               for part in check["exec"]["command"]]
                    assert subprocess.run(command, timeout=10).returncode == 0
