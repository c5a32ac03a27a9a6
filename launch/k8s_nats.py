"""The embedded NATS of a Kubernetes stack (`launch.k8s`): a one-replica StatefulSet with
JetStream's store on a PersistentVolumeClaim, a Service, and its configuration from a
ConfigMap beside the Secret `tandem-nats-server` (users, certificates), both projected into
/etc/nats. Pure.

The ConfigMap holds what is not secret (ports, JetStream, where the TLS files are) and
includes `authorization.conf` from the Secret: the users' bcrypt hashes and permissions
(`shared.nats_auth`). Clients connect over TLS with client certificates, as in the compose
stack; the monitoring port (not in the Service) answers the probes.
"""

from __future__ import annotations

from dataclasses import dataclass

from launch.k8s_objects import (
    config_map,
    container_security,
    http_probe,
    labels,
    metadata,
    pod_security,
    selector_labels,
    service,
)
from launch.k8s_secrets import AUTHORIZATION_FILE, CA_CERT, NATS_SERVER_SECRET, SERVER_CERT, SERVER_KEY
from shared.nats_auth import ServerTls, render_tls_config

NATS_PORT, NATS_MONITOR_PORT = 4222, 8222
CONFIG_DIR, STORE_DIR = "/etc/nats", "/data"
CONFIG_FILE = "nats.conf"
COMPONENT = "nats"


@dataclass(frozen=True, slots=True)
class NatsDeployment:
    name: str  # the Service's and the StatefulSet's: clients dial nats://<name>:4222
    kube_namespace: str
    instance: str
    image: str
    storage: str  # JetStream's volume, a quantity ("1Gi")

    @property
    def config_map_name(self) -> str:
        return f"{self.name}-config"

    @property
    def url(self) -> str:
        return f"nats://{self.name}:{NATS_PORT}"

    def documents(self) -> list[dict[str, object]]:
        return [self.config(), self.service(), self.stateful_set()]

    def config(self) -> dict[str, object]:
        return config_map(metadata(self.config_map_name, self.kube_namespace, labels(self.instance, COMPONENT)),
                          {CONFIG_FILE: server_config(CONFIG_DIR)})

    def service(self) -> dict[str, object]:
        return service(metadata(self.name, self.kube_namespace, labels(self.instance, COMPONENT)),
                       selector_labels(self.instance, COMPONENT), [("client", NATS_PORT)])

    def stateful_set(self) -> dict[str, object]:
        selected = selector_labels(self.instance, COMPONENT)
        container = {
            "name": "nats",
            "image": self.image,
            "command": ["nats-server", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}"],
            "ports": [{"name": "client", "containerPort": NATS_PORT, "protocol": "TCP"},
                      {"name": "monitor", "containerPort": NATS_MONITOR_PORT, "protocol": "TCP"}],
            "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                             {"name": "data", "mountPath": STORE_DIR}],
            "readinessProbe": http_probe("/healthz", "monitor", period_s=5),
            "livenessProbe": http_probe("/healthz", "monitor", period_s=10, failures=6),
            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                          "limits": {"cpu": "1", "memory": "1Gi"}},
            "securityContext": container_security(),
        }
        config_volume = {"name": "config", "projected": {"defaultMode": 0o440, "sources": [
            {"configMap": {"name": self.config_map_name, "items": [{"key": CONFIG_FILE, "path": CONFIG_FILE}]}},
            {"secret": {"name": NATS_SERVER_SECRET, "items": [
                {"key": key, "path": key} for key in (AUTHORIZATION_FILE, CA_CERT, SERVER_CERT, SERVER_KEY)]}},
        ]}}
        claim = {"metadata": {"name": "data", "labels": labels(self.instance, COMPONENT)},
                 "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": self.storage}}}}
        return {
            "apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": metadata(self.name, self.kube_namespace, labels(self.instance, COMPONENT)),
            "spec": {
                "serviceName": self.name,
                "replicas": 1,  # one server: JetStream's streams and buckets are not replicated
                "selector": {"matchLabels": selected},
                "template": {
                    "metadata": {"labels": labels(self.instance, COMPONENT)},
                    "spec": {"securityContext": pod_security(), "terminationGracePeriodSeconds": 30,
                             "containers": [container], "volumes": [config_volume]},
                },
                "volumeClaimTemplates": [claim],
            },
        }


def server_config(config_dir: str, store_dir: str = STORE_DIR) -> str:
    """nats.conf: the ports, JetStream's store, the users included from the Secret's file
    beside it, TLS with the Secret's certificates (`config_dir`: where both are mounted)."""
    tls = ServerTls(cert_file=f"{config_dir}/{SERVER_CERT}", key_file=f"{config_dir}/{SERVER_KEY}",
                    ca_file=f"{config_dir}/{CA_CERT}")
    return "\n".join([
        "# Rendered by `tandem k8s render`; the users come from the Secret tandem-nats-server.",
        "server_name: tandem-nats",  # JetStream keeps one identity across restarts
        f"port: {NATS_PORT}",
        f"http_port: {NATS_MONITOR_PORT}",
        "jetstream {",
        f'  store_dir: "{store_dir}"',
        "}",
        f"include {AUTHORIZATION_FILE}",
        "",
    ]) + render_tls_config(tls)
