"""NATS credentials files: one per service, holding its user and password, readable by its
owner only. The secret lives in the file; command lines, environment variables and logs
carry only the file's path.

The file is TOML:

    # Tandem NATS credentials of one service: keep private
    user = "router"
    password = "..."

The server keeps only bcrypt hashes of the passwords (`password_hash`).
"""

from __future__ import annotations

import os
import secrets
import tomllib
from pathlib import Path

import msgspec

from shared.config import ConfigError


class CredentialsError(ConfigError):
    pass


class Credentials(msgspec.Struct, frozen=True, kw_only=True):
    user: str
    password: str = msgspec.field(default="")

    def __repr__(self) -> str:  # never the password, whatever prints this
        return f"Credentials(user={self.user!r})"

    __str__ = __repr__


def new_password() -> str:
    return secrets.token_urlsafe(32)


def password_hash(password: str, rounds: int = 6) -> str:
    """The bcrypt hash nats-server checks the password against. The passwords are 256 random
    bits (`new_password`), out of reach of guessing whatever the cost: a low cost keeps a
    stack's start and each connection (the server hashes every attempt) fast."""
    import bcrypt

    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds)).decode()


def write_private(path: str | Path, text: str) -> Path:
    """Write `text` to a new file only its owner may read (0600), replacing any old one."""
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(text)
    return path


def write_credentials(path: str | Path, credentials: Credentials) -> Path:
    return write_private(path, "# Tandem NATS credentials of one service: keep private\n"
                               f"user = {_toml_string(credentials.user)}\n"
                               f"password = {_toml_string(credentials.password)}\n")


def _toml_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def read_credentials(path: str) -> Credentials:
    """The credentials in `path`; a `CredentialsError` naming the file (never its content)."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CredentialsError(f"NATS credentials file {path} does not exist") from None
    except OSError as error:
        raise CredentialsError(f"cannot read NATS credentials file {path}: {error.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        raise CredentialsError(f"NATS credentials file {path} is not a `user = ...`, `password = ...` file") from None
    user, password = data.get("user"), data.get("password")
    if not isinstance(user, str) or not user or not isinstance(password, str):
        raise CredentialsError(f"NATS credentials file {path} needs a user and a password")
    return Credentials(user=user, password=password)
