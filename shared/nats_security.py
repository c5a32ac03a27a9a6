"""Everything one secured NATS deployment needs, made in one directory: a password per
service (credentials files, 0600), the server's configuration (bcrypt hashes and
per-user permissions from `shared.nats_auth`, 0600), and with TLS a private CA, the
server's certificate and a client certificate per service (`shared.nats_tls`).

Layout of the directory (made afresh each time: old passwords stop working):
    nats-server.conf           the server's configuration
    creds/<user>.creds         each service's user and password
    tls/ca-cert.pem            the CA clients verify the server with (its key is deleted once
                               every certificate is issued)
    tls/server-{cert,key}.pem  the server's certificate and key
    tls/client-<user>-{cert,key}.pem

A service is pointed at its files with `bus_config(user, url)` or, for a child process,
the environment `env(user)` (`TANDEM_NATS_CREDS_FILE`, `TANDEM_NATS_CA_FILE`, ...): paths
only, never a secret. `user_files(directory, user)` names a user's files from the layout
alone (a worker that claims a slot finds its user's files this way).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from shared.config import BusConfig
from shared.nats_auth import AuthorizedUser, NatsUser, ServerTls, permissions, render_server_config, stack_users
from shared.nats_secrets import Credentials, new_password, password_hash, write_credentials, write_private
from shared.nats_tls import CertificateAuthority, CertPair
from shared.subjects import Subjects

ENV_CREDS_FILE = "TANDEM_NATS_CREDS_FILE"
ENV_CA_FILE = "TANDEM_NATS_CA_FILE"
ENV_CERT_FILE = "TANDEM_NATS_CERT_FILE"
ENV_KEY_FILE = "TANDEM_NATS_KEY_FILE"


def user_files(directory: str | Path, user: str, *, tls: bool = True) -> dict[str, str]:
    """The paths of `user`'s files in a directory of this layout, as `BusConfig` fields."""
    base = str(directory).rstrip("/")
    files = {"creds_file": f"{base}/creds/{user}.creds"}
    if tls:
        files.update(tls_ca_file=f"{base}/tls/ca-cert.pem", tls_cert_file=f"{base}/tls/client-{user}-cert.pem",
                     tls_key_file=f"{base}/tls/client-{user}-key.pem")
    return files


class NatsSecurity:
    def __init__(self, directory: Path, users: list[NatsUser], creds_files: dict[str, str],
                 ca_file: str, client_certs: dict[str, CertPair]) -> None:
        self.directory = directory
        self.users = users
        self.creds_files = creds_files
        self.ca_file = ca_file  # empty: no TLS
        self.client_certs = client_certs

    @property
    def server_config_file(self) -> str:
        return str(self.directory / "nats-server.conf")

    @property
    def tls(self) -> bool:
        return bool(self.ca_file)

    @classmethod
    def create(cls, directory: str | Path, namespace: str, worker_ids: list[str] | tuple[str, ...], *,
               tls: bool = True, hosts: tuple[str, ...] = ("127.0.0.1", "localhost", "::1"),
               shared_worker: bool = False) -> NatsSecurity:
        directory = Path(directory)
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True, mode=0o700)
        subjects = Subjects(namespace)
        users = stack_users(list(worker_ids), shared_worker=shared_worker)
        authorized, creds_files = [], {}
        for user in users:
            password = new_password()
            path = write_credentials(directory / "creds" / f"{user.name}.creds",
                                     Credentials(user=user.name, password=password))
            creds_files[user.name] = str(path)
            authorized.append(AuthorizedUser(name=user.name, password_hash=password_hash(password),
                                             permissions=permissions(user, subjects)))
        server_tls, ca_file, client_certs = None, "", {}
        if tls:
            authority = CertificateAuthority.create(directory / "tls")
            server = authority.issue_server(hosts)
            server_tls = ServerTls(cert_file=server.cert_file, key_file=server.key_file, ca_file=authority.ca_file)
            ca_file = authority.ca_file
            client_certs = {user.name: authority.issue_client(user.name) for user in users}
            authority.forget_key()  # nothing more to sign: the next deployment makes a new CA
        write_private(directory / "nats-server.conf", render_server_config(authorized, server_tls))
        return cls(directory, users, creds_files, ca_file, client_certs)

    def user_of(self, role_user: str) -> str:
        if role_user not in self.creds_files:
            raise KeyError(f"no NATS user {role_user!r} in {self.directory} (known: {', '.join(self.creds_files)})")
        return role_user

    def bus_config(self, user: str, nats_url: str, namespace: str) -> BusConfig:
        user = self.user_of(user)
        cert = self.client_certs.get(user)
        return BusConfig(nats_url=nats_url, namespace=namespace, creds_file=self.creds_files[user],
                         tls_ca_file=self.ca_file, tls_cert_file=cert.cert_file if cert else "",
                         tls_key_file=cert.key_file if cert else "")

    def env(self, user: str) -> dict[str, str]:
        """A child process's environment for `user`: its files' paths (the CLI reads them)."""
        config = self.bus_config(user, "", "")
        values = {ENV_CREDS_FILE: config.creds_file, ENV_CA_FILE: config.tls_ca_file,
                  ENV_CERT_FILE: config.tls_cert_file, ENV_KEY_FILE: config.tls_key_file}
        return {name: value for name, value in values.items() if value}
