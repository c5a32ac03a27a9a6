"""The secrets of the Docker Compose stack, made once in its `secrets` volume by the one-shot
`secrets` service (`tandem compose secrets /secrets`) before anything else starts:

    /secrets/api-keys.jsonl      the router's API keys (hashes only; TANDEM_API_KEYS_FILE)
    /secrets/api-key             the plaintext of the key named `local` (0600): read it with
                                 `docker compose exec router cat /secrets/api-key`
    /secrets/nats/               NATS users, TLS and the server's configuration
                                 (`shared.nats_security` layout: nats-server.conf, creds/, tls/)

A later start keeps what is there (the same key, the same NATS passwords); a missing part is
made again (a fresh NATS directory replaces a partial one). Every service mounts the volume
read-only and finds its files through `service_env`: paths only, never a secret in the
compose file, an environment value or a command line.

The workers' ids are their container host names (`--scale decode=3`), unknown when the
secrets are made: all workers share one NATS user, `worker` (`shared.nats_auth.shared_worker_user`),
which may act as any worker. The control services and the operator have a user each.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from launch.api_keys import KEY_FILE, KEYS_FILE, stack_keys
from shared.nats_auth import SHARED_WORKER, Role, user_name
from shared.nats_security import ENV_CA_FILE, ENV_CERT_FILE, ENV_CREDS_FILE, ENV_KEY_FILE, NatsSecurity

SECRETS_DIR = "/secrets"
NATS_DIR = "nats"
SERVER_CONFIG = "nats-server.conf"
API_KEYS_ENV = "TANDEM_API_KEYS_FILE"


@dataclass(frozen=True, slots=True)
class ComposeSecrets:
    api_keys_file: Path
    api_key_file: Path
    nats_dir: Path
    made_nats: bool  # False: an earlier start's were kept


def ensure_secrets(directory: str | Path, namespace: str, nats_hosts: tuple[str, ...]) -> ComposeSecrets:
    """Make whatever of the stack's secrets `directory` lacks; keep the rest."""
    directory = Path(directory)
    keys = stack_keys(directory)
    nats_dir = directory / NATS_DIR
    complete = (nats_dir / SERVER_CONFIG).exists() and all(
        (nats_dir / "creds" / f"{user}.creds").exists() for user in compose_users())
    if not complete:  # made whole, or not at all: the config and the files must match
        NatsSecurity.create(nats_dir, namespace, [], hosts=nats_hosts, shared_worker=True)
    assert keys.key_file is not None
    return ComposeSecrets(keys.keys_file, keys.key_file, nats_dir, made_nats=not complete)


def compose_users() -> tuple[str, ...]:
    return (*(user_name(role) for role in (Role.ROUTER, Role.ORCHESTRATOR, Role.METRICS, Role.OPERATOR)),
            SHARED_WORKER)


def nats_env(user: str, secrets_dir: str = SECRETS_DIR) -> dict[str, str]:
    """The `TANDEM_NATS_*` environment of a service connecting as `user`: paths in the volume."""
    base = f"{secrets_dir}/{NATS_DIR}"
    return {ENV_CREDS_FILE: f"{base}/creds/{user}.creds", ENV_CA_FILE: f"{base}/tls/ca-cert.pem",
            ENV_CERT_FILE: f"{base}/tls/client-{user}-cert.pem", ENV_KEY_FILE: f"{base}/tls/client-{user}-key.pem"}


def api_keys_env(secrets_dir: str = SECRETS_DIR) -> dict[str, str]:
    return {API_KEYS_ENV: f"{secrets_dir}/{KEYS_FILE}"}


def api_key_path(secrets_dir: str = SECRETS_DIR) -> str:
    return f"{secrets_dir}/{KEY_FILE}"


def server_config_path(secrets_dir: str = SECRETS_DIR) -> str:
    return f"{secrets_dir}/{NATS_DIR}/{SERVER_CONFIG}"
