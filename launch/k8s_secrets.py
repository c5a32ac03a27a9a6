"""The secrets of a Kubernetes stack (`launch.k8s`): what the Secrets are called, what they
hold, where pods find their files, and how they are made (`tandem k8s secrets`).

The main manifest names Secrets and never holds one. `make_secret_documents` makes every
secret afresh (new NATS passwords, a new private CA, a new API key) as Secret objects, which
`tandem k8s secrets -o FILE` writes to a file of their own (0600), applied once:

    tandem-nats-server   authorization.conf (NATS users: bcrypt hashes, permissions),
                         the server's certificate and key, the CA certificate
    tandem-nats-<user>   one per NATS user (router, orchestrator, metrics, worker, operator):
                         <user>.creds, its client certificate and key, the CA certificate
    tandem-api-keys      api-keys.jsonl: the router's API keys (hashes only)
    tandem-api-key       api-key: the plaintext of the key named `local`; mounted nowhere,
                         read with kubectl (docs/kubernetes.md)

A service pod mounts one projected volume at /secrets with the compose stack's layout
(`launch.compose_secrets`), so its `TANDEM_NATS_*` and `TANDEM_API_KEYS_FILE` variables are
the compose stack's: paths only. All workers share the NATS user `worker`: replicas come and
go with names unknown when the secrets are made.
"""

from __future__ import annotations

import base64
import tempfile
from collections.abc import Mapping
from pathlib import Path

from launch.api_keys import KEY_FILE, KEYS_FILE, stack_keys
from launch.compose_secrets import NATS_DIR, SECRETS_DIR, control_users
from launch.k8s_objects import APP, labels, metadata
from shared.nats_auth import SHARED_WORKER, AuthorizedUser, permissions, render_server_config
from shared.nats_secrets import password_hash, read_credentials, write_private
from shared.nats_security import NatsSecurity
from shared.subjects import Subjects

NATS_SERVER_SECRET = f"{APP}-nats-server"
API_KEYS_SECRET = f"{APP}-api-keys"
API_KEY_SECRET = f"{APP}-api-key"
AUTHORIZATION_FILE = "authorization.conf"
SECRETS_MOUNT = SECRETS_DIR  # where a service pod finds its files
CA_CERT, SERVER_CERT, SERVER_KEY = "ca-cert.pem", "server-cert.pem", "server-key.pem"


def nats_user_secret(user: str) -> str:
    return f"{APP}-nats-{user}"


def user_files(user: str) -> dict[str, str]:
    """A NATS user's Secret keys -> their paths under /secrets (`launch.compose_secrets.nats_env`)."""
    return {f"{user}.creds": f"{NATS_DIR}/creds/{user}.creds", CA_CERT: f"{NATS_DIR}/tls/{CA_CERT}",
            f"client-{user}-cert.pem": f"{NATS_DIR}/tls/client-{user}-cert.pem",
            f"client-{user}-key.pem": f"{NATS_DIR}/tls/client-{user}-key.pem"}


def secrets_volume(name: str, nats_user: str, *, api_keys: bool = False) -> dict[str, object] | None:
    """A pod's /secrets: its NATS user's files (`nats_user` empty: none, an external NATS) and,
    for the router, the API key file. None: nothing to mount."""
    sources: list[dict[str, object]] = []
    if nats_user:
        sources.append({"secret": {"name": nats_user_secret(nats_user), "items": [
            {"key": key, "path": path} for key, path in user_files(nats_user).items()]}})
    if api_keys:
        sources.append({"secret": {"name": API_KEYS_SECRET, "items": [{"key": KEYS_FILE, "path": KEYS_FILE}]}})
    return {"name": name, "projected": {"sources": sources, "defaultMode": 0o440}} if sources else None


def nats_server_hosts(service_name: str, kube_namespace: str) -> tuple[str, ...]:
    """The names the NATS server's certificate is valid for: the Service's names inside the
    cluster, and loopback for `kubectl port-forward`."""
    return (service_name, f"{service_name}.{kube_namespace}", f"{service_name}.{kube_namespace}.svc",
            f"{service_name}.{kube_namespace}.svc.cluster.local", "localhost", "127.0.0.1")


def secret_object(name: str, kube_namespace: str, instance: str, files: Mapping[str, bytes]) -> dict[str, object]:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": metadata(name, kube_namespace, labels(instance, "secrets")),
            "data": {key: base64.b64encode(value).decode("ascii") for key, value in sorted(files.items())}}


def make_secret_documents(*, namespace: str, kube_namespace: str, instance: str,
                          nats_service: str) -> list[dict[str, object]]:
    """Every secret of the stack, made now (I/O: a private temporary directory, removed after)."""
    with tempfile.TemporaryDirectory(prefix="tandem-k8s-secrets-") as scratch:
        root = Path(scratch)
        hosts = nats_server_hosts(nats_service, kube_namespace)
        security = NatsSecurity.create(root / "nats", namespace, [], hosts=hosts, shared_worker=True)
        keys = stack_keys(root / "keys")
        assert keys.key_file is not None
        tls = root / "nats" / "tls"
        server = {AUTHORIZATION_FILE: _authorization(security, namespace).encode(),
                  CA_CERT: (tls / CA_CERT).read_bytes(), SERVER_CERT: (tls / SERVER_CERT).read_bytes(),
                  SERVER_KEY: (tls / SERVER_KEY).read_bytes()}
        documents = [secret_object(NATS_SERVER_SECRET, kube_namespace, instance, server)]
        for user in (*control_users(), SHARED_WORKER):
            files = {key: (root / "nats" / path.removeprefix(f"{NATS_DIR}/")).read_bytes()
                     for key, path in user_files(user).items()}
            documents.append(secret_object(nats_user_secret(user), kube_namespace, instance, files))
        documents.append(secret_object(API_KEYS_SECRET, kube_namespace, instance,
                                       {KEYS_FILE: keys.keys_file.read_bytes()}))
        documents.append(secret_object(API_KEY_SECRET, kube_namespace, instance,
                                       {KEY_FILE: keys.key_file.read_bytes()}))
    return documents


def _authorization(security: NatsSecurity, namespace: str) -> str:
    """The users' part of the server configuration. `NatsSecurity` wrote a whole one, with
    TLS paths of its scratch directory; the pod's paths differ, so the users are rendered
    again from the credentials just made (TLS is in the ConfigMap, `launch.k8s_nats`)."""
    subjects = Subjects(namespace)
    authorized = [AuthorizedUser(name=user.name,
                                 password_hash=password_hash(read_credentials(security.creds_files[user.name]).password),
                                 permissions=permissions(user, subjects))
                  for user in security.users]
    return render_server_config(authorized)


def write_secrets_file(path: str | Path, text: str) -> Path:
    """`text` in a file only its owner reads (0600); an existing file is refused, not replaced:
    applying fresh secrets over running ones changes every password."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists: remove it first to make new secrets")
    return write_private(path, text)
