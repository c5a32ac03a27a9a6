"""The local stack's NATS, secured: with `StackConfig.nats_security_dir` set, the embedded
nats-server starts with a user per service (its permissions from `shared.nats_auth`) and
TLS, and each service process gets the paths of its own files in its environment
(`shared.nats_security.NatsSecurity.env`): never a secret on a command line.

The launcher itself connects as the operator (it reads membership to see workers ready).
Workers are known up front: a worker id the stack was not planned with has no user.
With a NATS of one's own (`nats_url`), the launcher and every service use the files the
environment names (`TANDEM_NATS_CREDS_FILE`, ...): one identity for the whole stack.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from launch.plan import StackConfig
from shared.config import BusConfig
from shared.nats_auth import Role, user_name
from shared.nats_security import ENV_CA_FILE, ENV_CERT_FILE, ENV_CREDS_FILE, ENV_KEY_FILE, NatsSecurity
from shared.nats_server import EmbeddedNats

CONTROL_USERS = {"router": Role.ROUTER, "metrics": Role.METRICS, "orchestrator": Role.ORCHESTRATOR}


def start_embedded_nats(config: StackConfig) -> tuple[EmbeddedNats, NatsSecurity | None]:
    store_dir = str(Path(config.log_dir) / "nats")
    if not config.nats_security_dir:
        return EmbeddedNats(store_dir).start(), None
    security = NatsSecurity.create(config.nats_security_dir, config.namespace,
                                   [spec.worker_id for spec in config.workers])
    server = EmbeddedNats(store_dir, config_file=security.server_config_file, tls=security.tls).start()
    return server, security


def service_user(name: str) -> str:
    """The NATS user of the stack process `name` (a control service or a worker id)."""
    role = CONTROL_USERS.get(name)
    return user_name(role) if role is not None else user_name(Role.WORKER, name)


def service_env(security: NatsSecurity | None, name: str) -> dict[str, str] | None:
    if security is None:
        return None
    user = service_user(name)
    if user not in security.creds_files:
        raise RuntimeError(f"{name} has no NATS user: the stack's NATS was secured for the workers it was "
                           f"planned with ({', '.join(u.worker_id for u in security.users if u.worker_id)})")
    return security.env(user)


def operator_bus(security: NatsSecurity | None, nats_url: str, namespace: str,
                 environ: Mapping[str, str] = os.environ) -> BusConfig:
    """The launcher's connection: the operator's files on a secured embedded NATS; on a NATS
    of one's own, the `TANDEM_NATS_*` files of the environment, which the services inherit too."""
    if security is None:
        return BusConfig(nats_url=nats_url, namespace=namespace, creds_file=environ.get(ENV_CREDS_FILE, ""),
                         tls_ca_file=environ.get(ENV_CA_FILE, ""), tls_cert_file=environ.get(ENV_CERT_FILE, ""),
                         tls_key_file=environ.get(ENV_KEY_FILE, ""))
    return security.bus_config(user_name(Role.OPERATOR), nats_url, namespace)
