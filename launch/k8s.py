"""The stack definition rendered as Kubernetes manifests (`tandem k8s render`).

`tandem up`, `docker compose up` and `kubectl apply` run the same stack: all three come from
one `StackDefinition` (`launch/stacks/local.toml`). `k8s_documents(definition, options)`
gives the objects as plain data; `render_k8s` as one multi-document YAML text. Pure: no I/O.

What the definition gives: the services and their settings (the compose stack's command
lines, `launch.compose_args`), ports, health paths, the namespace, membership timing and
the worker groups (`count` -> a Deployment's replicas). What the deployment adds: images
(`K8sOptions`), an embedded NATS (`launch.k8s_nats`) unless the definition names one, the
tiny model made by an init container in each pod that reads a model (or, with a
`model_dir`, a PersistentVolumeClaim mounted there), probes (the router: liveness `/health`,
readiness `/ready`; the collector `/health`; services without HTTP: their NATS connection),
resources, and drain on stop (a worker finishes its requests within its grace period).

Secrets are named, never held: the Secrets come from `tandem k8s secrets`
(`launch.k8s_secrets`), a file of their own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from launch.compose_args import ContainerArgs
from launch.compose_secrets import api_keys_env, nats_env
from launch.compose_yaml import to_yaml
from launch.definition import (
    METRICS,
    ORCHESTRATOR,
    ROUTER,
    DefinitionError,
    StackDefinition,
    WorkerGroup,
    checked,
    with_overrides,
)
from launch.k8s_nats import NATS_PORT, NatsDeployment
from launch.k8s_objects import (
    APP,
    ROLE_LABEL,
    Resources,
    container_security,
    deployment,
    http_probe,
    labels,
    metadata,
    nats_connected_probe,
    pod_security,
    rolling,
    selector_labels,
    service,
)
from launch.k8s_secrets import SECRETS_MOUNT, secrets_volume
from services.worker.engines import engine_spec
from shared.nats_auth import SHARED_WORKER

MODELS_MOUNT, TINY_MODEL_DIR = "/models", "/models/tiny"
ROUTER_READY = "/ready"  # readiness: a worker serves the model; the definition's `health` is liveness
METRICS_HEALTH = "/health"  # open even when the collector guards /metrics
WORKER = "worker"
_DNS_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")

ROUTER_RESOURCES = Resources("500m", "512Mi", "2", "2Gi")
CONTROL_RESOURCES = Resources("100m", "256Mi", "1", "1Gi")


@dataclass(frozen=True, slots=True)
class K8sOptions:
    """What a cluster needs beyond the definition. Images are the user's own (pushed to a
    registry the cluster pulls from)."""

    image: str = "tandem:latest"
    worker_image: str = ""  # empty: `image` (a vLLM build for --engine vllm: tandem-vllm-gpu)
    nats_image: str = "nats:2.10-alpine"
    engine: str = ""  # empty: each group's own engine
    kube_namespace: str = "tandem"
    gpus_per_worker: int = 0  # nvidia.com/gpu per worker pod (vLLM on GPUs)
    nats_storage: str = "1Gi"
    model_storage: str = "50Gi"  # the model's claim, when the definition names a model_dir
    otlp_endpoint: str = ""  # non-empty: traces exported there (TANDEM_TRACE_EXPORTER=otlp)
    log_level: str = "info"
    image_pull_policy: str = "IfNotPresent"


HEADER = """\
# Generated from a Tandem stack definition by `tandem k8s render`: edit the definition, not this.
# Secrets are not here: make them with `tandem k8s secrets -o secrets.yaml` (docs/kubernetes.md).
#   kubectl create namespace {namespace}
#   kubectl apply -f secrets.yaml && kubectl apply -f this-file.yaml
"""


def render_k8s(definition: StackDefinition, options: K8sOptions = K8sOptions()) -> str:
    """The manifests' text: one YAML document per object."""
    documents = k8s_documents(definition, options)
    return HEADER.format(namespace=options.kube_namespace) + "---\n".join(to_yaml(doc) for doc in documents)


def nats_deployment(definition: StackDefinition, options: K8sOptions) -> NatsDeployment:
    return NatsDeployment(name=f"{APP}-nats", kube_namespace=options.kube_namespace, instance=definition.name,
                          image=options.nats_image, storage=options.nats_storage)


def k8s_documents(definition: StackDefinition, options: K8sOptions = K8sOptions()) -> list[dict[str, object]]:
    if options.engine:
        definition = with_overrides(definition, engine=options.engine)
    definition = checked(definition, definition.name)
    problems = k8s_problems(definition, options)
    if problems:
        raise DefinitionError(f"{definition.name}: " + "; ".join(problems))
    nats = nats_deployment(definition, options)
    documents: list[dict[str, object]] = [] if definition.nats.url else nats.documents()
    pods = _Pods(definition, options, ContainerArgs(definition, definition.nats.url or nats.url,
                                                    definition.model_dir or TINY_MODEL_DIR))
    if definition.model_dir:
        documents.append(pods.model_claim())
    documents += pods.orchestrator() + pods.metrics() + pods.router()
    for group in definition.workers:
        documents.append(pods.worker(group))
    return documents


def k8s_problems(definition: StackDefinition, options: K8sOptions) -> list[str]:
    """What Kubernetes would refuse in names that come from the definition or the options:
    object names and label values are DNS labels (no '_'; 63 characters at most)."""
    problems = [f"{what} {value!r} is not a Kubernetes name (lower case, digits, '-'; at most {limit})"
                for what, value, limit in [
                    ("name", definition.name, 63), ("--kube-namespace", options.kube_namespace, 63),
                    *[("worker group", group.name, 63 - len(APP) - 1) for group in definition.workers]]
                if not _DNS_LABEL.fullmatch(value) or len(value) > limit]
    engines = sorted({group.engine for group in definition.workers
                      if not engine_spec(group.engine).deployment.in_tandem_image})
    if engines and not options.worker_image:
        problems.append(f"workers run {', '.join(engines)}: name their image with --worker-image "
                        f"(the Tandem image does not have them)")
    if options.gpus_per_worker < 0:
        problems.append(f"--gpus-per-worker {options.gpus_per_worker}: cannot be negative")
    return problems


@dataclass(frozen=True, slots=True)
class _Pods:
    definition: StackDefinition
    options: K8sOptions
    args: ContainerArgs

    def _name(self, component: str) -> str:
        return f"{APP}-{component}"

    def _meta(self, component: str, group: str = "", **extra: str) -> dict[str, object]:
        return metadata(self._name(group or component), self.options.kube_namespace,
                        labels(self.definition.name, component, group, **extra))

    def orchestrator(self) -> list[dict[str, object]]:
        container = self._container(ORCHESTRATOR, self.options.image, self.args.orchestrator(), CONTROL_RESOURCES)
        container["readinessProbe"] = nats_connected_probe(NATS_PORT)
        container["livenessProbe"] = nats_connected_probe(NATS_PORT, failures=6)
        spec = self._pod_spec(container, "orchestrator", grace_s=30)
        # One membership owner at a time: the old one stops before the new one starts.
        return [self._deployment(ORCHESTRATOR, spec, replicas=1, strategy={"type": "Recreate"})]

    def metrics(self) -> list[dict[str, object]]:
        port = self.definition.metrics.port
        container = self._container(METRICS, self.options.image, self.args.metrics(), CONTROL_RESOURCES)
        container["ports"] = [{"name": "http", "containerPort": port, "protocol": "TCP"}]
        container["readinessProbe"] = http_probe(METRICS_HEALTH, "http", period_s=5)
        container["livenessProbe"] = http_probe(METRICS_HEALTH, "http", failures=6)
        spec = self._pod_spec(container, "metrics", grace_s=30)
        return [self._deployment(METRICS, spec, replicas=1, strategy=rolling(), scrape_port=port),
                service(self._meta(METRICS), selector_labels(self.definition.name, METRICS), [("http", port)])]

    def router(self) -> list[dict[str, object]]:
        router = self.definition.router
        container = self._container(ROUTER, self.options.image, self.args.router(), ROUTER_RESOURCES,
                                    extra_env=api_keys_env())
        container["ports"] = [{"name": "http", "containerPort": router.port, "protocol": "TCP"}]
        container["startupProbe"] = http_probe(router.health, "http", period_s=2, failures=90)
        container["readinessProbe"] = http_probe(ROUTER_READY, "http", period_s=5)
        container["livenessProbe"] = http_probe(router.health, "http", failures=6)
        spec = self._pod_spec(container, "router", grace_s=60, model=True, api_keys=True)
        # `routers` replicas behind the Service: each pod's router shares its predicted load
        # with the others over NATS (a random router id each), as `tandem up --routers N`'s do
        return [self._deployment(ROUTER, spec, replicas=self.definition.routers, strategy=rolling(),
                                 scrape_port=router.port),
                service(self._meta(ROUTER), selector_labels(self.definition.name, ROUTER), [("http", router.port)])]

    def worker(self, group: WorkerGroup) -> dict[str, object]:
        deployment = engine_spec(group.engine).deployment
        image = self.options.worker_image or self.options.image
        resources = Resources(deployment.cpu_request, deployment.memory_request, deployment.cpu_limit,
                              deployment.memory_limit, gpus=self.options.gpus_per_worker)
        # Each replica's worker id is its pod's name (Kubernetes expands $(POD_NAME)).
        command = self.args.worker(group, worker_id="$(POD_NAME)")
        container = self._container(WORKER, image, command, resources, field_env={"POD_NAME": "metadata.name"})
        # An engine that loads a model before it joins gets a long start before the liveness probe counts.
        container["startupProbe"] = nats_connected_probe(NATS_PORT, period_s=5,
                                                         failures=deployment.start_grace_s // 5)
        container["readinessProbe"] = nats_connected_probe(NATS_PORT)
        container["livenessProbe"] = nats_connected_probe(NATS_PORT, failures=6)
        spec = self._pod_spec(container, WORKER, grace_s=deployment.stop_grace_s, model=True,
                              shm=bool(deployment.shm_size))
        pod_labels = {ROLE_LABEL: group.role.value}
        return self._deployment(WORKER, spec, replicas=group.count, strategy=rolling(), group=group.name,
                                pod_labels=pod_labels)

    def model_claim(self) -> dict[str, object]:
        """The model's volume: filled once by the user (docs/kubernetes.md), read by every pod."""
        return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": metadata(
                    self._name("models"), self.options.kube_namespace, labels(self.definition.name, "model")),
                "spec": {"accessModes": ["ReadWriteMany"],
                         "resources": {"requests": {"storage": self.options.model_storage}}}}

    def _container(self, component: str, image: str, command: list[str], resources: Resources, *,
                   extra_env: dict[str, str] | None = None,
                   field_env: dict[str, str] | None = None) -> dict[str, object]:
        """`field_env`: variables set from the pod's own fields (`metadata.name`, ...), first in `env`."""
        environment = {"TANDEM_LOG_LEVEL": self.options.log_level,
                       "TANDEM_TRACE_EXPORTER": "otlp" if self.options.otlp_endpoint else "none"}
        if self.options.otlp_endpoint:
            environment["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = self.options.otlp_endpoint
        if not self.definition.nats.url:  # the embedded NATS: this service's user, paths under /secrets
            environment.update(nats_env(_nats_user(component), SECRETS_MOUNT))
        environment.update(extra_env or {})
        env: list[dict[str, object]] = [{"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
                                        for name, path in (field_env or {}).items()]
        env.extend({"name": name, "value": value} for name, value in environment.items())
        # The image's entrypoint is `tandem`: the command line is its arguments.
        return {"name": component, "image": image, "imagePullPolicy": self.options.image_pull_policy,
                "args": command, "env": env,
                "resources": resources.spec(), "securityContext": container_security(), "volumeMounts": []}

    def _pod_spec(self, container: dict[str, object], component: str, *, grace_s: int, model: bool = False,
                  api_keys: bool = False, shm: bool = False) -> dict[str, object]:
        volumes: list[dict[str, object]] = []
        mounts: list[dict[str, object]] = []
        container["volumeMounts"] = mounts  # replaces `_container`'s empty list, in its place
        init: list[dict[str, object]] = []
        secrets = secrets_volume("secrets", "" if self.definition.nats.url else _nats_user(component),
                                 api_keys=api_keys)
        if secrets is not None:
            volumes.append(secrets)
            mounts.append({"name": "secrets", "mountPath": SECRETS_MOUNT, "readOnly": True})
        if model and self.definition.model_dir:
            volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": self._name("models"),
                                                                       "readOnly": True}})
            mounts.append({"name": "model", "mountPath": self.definition.model_dir, "readOnly": True})
        elif model:
            # The tiny model is generated (fixed seed: the same in every pod) into the pod's own volume.
            volumes.append({"name": "models", "emptyDir": {}})
            mounts.append({"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True})
            init.append({"name": "tiny-model", "image": self.options.image,
                         "imagePullPolicy": self.options.image_pull_policy,
                         "args": ["model", "tiny", TINY_MODEL_DIR],
                         "resources": Resources("250m", "256Mi", "1", "1Gi").spec(),
                         "securityContext": container_security(),
                         "volumeMounts": [{"name": "models", "mountPath": MODELS_MOUNT}]})
        if shm:  # vLLM's worker processes share tensors through /dev/shm
            volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}})
            mounts.append({"name": "shm", "mountPath": "/dev/shm"})
        if not mounts:
            del container["volumeMounts"]
        spec: dict[str, object] = {
            "securityContext": pod_security(),
            # The pause container is PID 1: it reaps the service's children; SIGTERM reaches
            # the service, which drains within the grace period.
            "shareProcessNamespace": True,
            "terminationGracePeriodSeconds": grace_s,
            "automountServiceAccountToken": False,
            "containers": [container],
        }
        if init:
            spec["initContainers"] = init
        if volumes:
            spec["volumes"] = volumes
        return spec

    def _deployment(self, component: str, pod_spec: dict[str, object], *, replicas: int,
                    strategy: dict[str, object], group: str = "", scrape_port: int = 0,
                    pod_labels: dict[str, str] | None = None) -> dict[str, object]:
        instance = self.definition.name
        annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(scrape_port),
                       "prometheus.io/path": "/metrics"} if scrape_port else None
        return deployment(self._meta(component, group), selector_labels(instance, component, group),
                          labels(instance, component, group, **(pod_labels or {})), pod_spec,
                          replicas=replicas, strategy=strategy, pod_annotations=annotations)


def _nats_user(component: str) -> str:
    return SHARED_WORKER if component == WORKER else component

