"""The secrets of the Docker Compose stack, made once in its `secrets` volume by the one-shot
`secrets` service (`tandem compose secrets /secrets --worker-slots N --slots-dir /slots`)
before anything else starts:

    /secrets/api-keys.jsonl      the router's API keys (hashes only; TANDEM_API_KEYS_FILE)
    /secrets/api-key             the plaintext of the key named `local` (0600): read it with
                                 `docker compose exec router cat /secrets/api-key`
    /secrets/nats/               NATS users, TLS and the server's configuration
                                 (`shared.nats_security` layout: nats-server.conf, creds/, tls/)
    /slots/w01.lock ...          the worker slots (`shared.worker_slots`), in the `slots` volume

A later start keeps what is there (the same key, the same NATS passwords); a missing part is
made again (a fresh NATS directory replaces a partial one, so more slots than before means
new passwords for everyone: restart the whole stack). Every service mounts the secrets
volume read-only and finds its files through `nats_env` or, for a worker, through the slot it
claims: paths only, never a secret in the compose file, an environment value or a command line.

Workers are replicas (`--scale decode=3`) whose ids are not known when the secrets are made,
so the secrets hold N worker slots, each a worker id (`w01` ... `wNN`) with its own NATS
user of exactly the permissions `tandem up` gives a worker (`shared.nats_auth`): a worker
claims a free slot when it starts and holds it while it runs. No user may act as any worker;
a worker's credentials cannot drain another worker or read its requests. The control
services and the operator have a user each.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from launch.api_keys import KEY_FILE, KEYS_FILE, stack_keys
from shared.nats_auth import Role, user_name
from shared.nats_security import ENV_CA_FILE, ENV_CERT_FILE, ENV_CREDS_FILE, ENV_KEY_FILE, NatsSecurity, user_files
from shared.worker_slots import make_slots, slot_ids

SECRETS_DIR = "/secrets"
SLOTS_DIR = "/slots"
NATS_DIR = "nats"
SERVER_CONFIG = "nats-server.conf"
API_KEYS_ENV = "TANDEM_API_KEYS_FILE"
DEFAULT_WORKER_SLOTS = 8


@dataclass(frozen=True, slots=True)
class ComposeSecrets:
    api_keys_file: Path
    api_key_file: Path
    nats_dir: Path
    made_nats: bool  # False: an earlier start's were kept
    worker_slots: tuple[str, ...]


def ensure_secrets(directory: str | Path, namespace: str, nats_hosts: tuple[str, ...], *,
                   worker_slots: int = DEFAULT_WORKER_SLOTS, slots_dir: str | Path | None = None) -> ComposeSecrets:
    """Make whatever of the stack's secrets `directory` lacks (NATS users for `worker_slots`
    slots among them) and, in `slots_dir`, the slots' files; keep the rest."""
    if worker_slots < 1:
        raise ValueError("at least one worker slot is needed")
    directory = Path(directory)
    keys = stack_keys(directory)
    nats_dir = directory / NATS_DIR
    slots = slot_ids(worker_slots)
    complete = (nats_dir / SERVER_CONFIG).exists() and all(
        (nats_dir / "creds" / f"{user}.creds").exists() for user in compose_users(slots))
    if not complete:  # made whole, or not at all: the config and the files must match
        NatsSecurity.create(nats_dir, namespace, slots, hosts=nats_hosts)
    if slots_dir is not None:
        make_slots(slots_dir, worker_slots)
    assert keys.key_file is not None
    return ComposeSecrets(keys.keys_file, keys.key_file, nats_dir, made_nats=not complete, worker_slots=slots)


def control_users() -> tuple[str, ...]:
    """The control services' and the operator's NATS users."""
    return tuple(user_name(role) for role in (Role.ROUTER, Role.ORCHESTRATOR, Role.METRICS, Role.OPERATOR))


def compose_users(slots: tuple[str, ...]) -> tuple[str, ...]:
    return (*control_users(), *(user_name(Role.WORKER, slot) for slot in slots))


def nats_env(user: str, secrets_dir: str = SECRETS_DIR) -> dict[str, str]:
    """The `TANDEM_NATS_*` environment of a service connecting as `user`: paths in the volume."""
    files = user_files(nats_dir_path(secrets_dir), user)
    return {ENV_CREDS_FILE: files["creds_file"], ENV_CA_FILE: files["tls_ca_file"],
            ENV_CERT_FILE: files["tls_cert_file"], ENV_KEY_FILE: files["tls_key_file"]}


def nats_dir_path(secrets_dir: str = SECRETS_DIR) -> str:
    return f"{secrets_dir}/{NATS_DIR}"


def api_keys_env(secrets_dir: str = SECRETS_DIR) -> dict[str, str]:
    return {API_KEYS_ENV: f"{secrets_dir}/{KEYS_FILE}"}


def api_key_path(secrets_dir: str = SECRETS_DIR) -> str:
    return f"{secrets_dir}/{KEY_FILE}"


def server_config_path(secrets_dir: str = SECRETS_DIR) -> str:
    return f"{secrets_dir}/{NATS_DIR}/{SERVER_CONFIG}"
