"""Kubernetes objects as plain dicts, the pieces `launch.k8s` and `launch.k8s_nats` build a
stack's manifests from: labels and metadata, Deployments, Services, probes, resources and the
containers' security context. Pure: no I/O, no Kubernetes client.

Every object of a stack carries the same labels (`labels(instance, component)`); a workload's
selector is its `selector_labels`, which its pods carry and its Service selects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
PART_OF_LABEL = "app.kubernetes.io/part-of"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
GROUP_LABEL = "tandem/worker-group"
ROLE_LABEL = "tandem/role"
APP = "tandem"
IMAGE_USER = 10001  # the image's `tandem` user (compose/Dockerfile)


def selector_labels(instance: str, component: str, group: str = "") -> dict[str, str]:
    """What a workload's pods are selected by: the stack, the component, a worker group."""
    selected = {NAME_LABEL: APP, INSTANCE_LABEL: instance, COMPONENT_LABEL: component}
    if group:
        selected[GROUP_LABEL] = group
    return selected


def labels(instance: str, component: str, group: str = "", **extra: str) -> dict[str, str]:
    return {**selector_labels(instance, component, group), PART_OF_LABEL: APP, MANAGED_BY_LABEL: APP, **extra}


def metadata(name: str, namespace: str, object_labels: Mapping[str, str],
             annotations: Mapping[str, str] | None = None) -> dict[str, object]:
    meta: dict[str, object] = {"name": name, "namespace": namespace, "labels": dict(object_labels)}
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


@dataclass(frozen=True, slots=True)
class Resources:
    cpu_request: str
    memory_request: str
    cpu_limit: str
    memory_limit: str
    gpus: int = 0  # nvidia.com/gpu, requested and limited alike

    def spec(self) -> dict[str, object]:
        requests: dict[str, object] = {"cpu": self.cpu_request, "memory": self.memory_request}
        limits: dict[str, object] = {"cpu": self.cpu_limit, "memory": self.memory_limit}
        if self.gpus:
            requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(self.gpus)
        return {"requests": requests, "limits": limits}


def http_probe(path: str, port: str, *, period_s: int = 10, failures: int = 3) -> dict[str, object]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period_s, "timeoutSeconds": 3,
            "failureThreshold": failures}


def exec_probe(command: list[str], *, period_s: int = 10, failures: int = 3) -> dict[str, object]:
    return {"exec": {"command": command}, "periodSeconds": period_s, "timeoutSeconds": 3,
            "failureThreshold": failures}


def nats_connected_probe(nats_port: int, *, period_s: int = 10, failures: int = 3) -> dict[str, object]:
    """For a service without an HTTP port (orchestrator, workers): the container holds an
    established TCP connection to NATS (`/proc/net/tcp*`: remote port in hex, then state 01).
    One `grep`, no interpreter start-up; a service cut off from the bus fails it."""
    pattern = f":{nats_port:04X} 01 "
    return exec_probe(["sh", "-c", f"grep -q '{pattern}' /proc/net/tcp /proc/net/tcp6"],
                      period_s=period_s, failures=failures)


def container_security() -> dict[str, object]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def pod_security(user: int = IMAGE_USER) -> dict[str, object]:
    """Not root; mounted secrets belong to the pod's group (`fsGroup`), readable through it."""
    return {"runAsNonRoot": True, "runAsUser": user, "runAsGroup": user, "fsGroup": user,
            "seccompProfile": {"type": "RuntimeDefault"}}


def deployment(meta: dict[str, object], selected: Mapping[str, str], pod_labels: Mapping[str, str],
               pod_spec: dict[str, object], *, replicas: int, strategy: dict[str, object],
               pod_annotations: Mapping[str, str] | None = None) -> dict[str, object]:
    template_meta: dict[str, object] = {"labels": dict(pod_labels)}
    if pod_annotations:
        template_meta["annotations"] = dict(pod_annotations)
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
            "spec": {"replicas": replicas, "selector": {"matchLabels": dict(selected)}, "strategy": strategy,
                     "template": {"metadata": template_meta, "spec": pod_spec}}}


def rolling(max_surge: int | str = 1, max_unavailable: int | str = 0) -> dict[str, object]:
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": max_surge, "maxUnavailable": max_unavailable}}


def service(meta: dict[str, object], selected: Mapping[str, str], ports: list[tuple[str, int]]) -> dict[str, object]:
    """A ClusterIP Service over `selected` pods; `ports`: (name, port), the target the
    container port of the same name."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta,
            "spec": {"type": "ClusterIP", "selector": dict(selected),
                     "ports": [{"name": name, "port": port, "targetPort": name, "protocol": "TCP"}
                               for name, port in ports]}}


def config_map(meta: dict[str, object], data: Mapping[str, str]) -> dict[str, object]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": dict(data)}
