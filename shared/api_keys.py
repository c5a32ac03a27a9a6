"""API keys: the key file's format, the key table and its lookup. Pure: no I/O, no clock.

A key file holds JSON lines, one key a line (blank lines and `#` comments are skipped):

    {"name": "local", "sha256": "<hex digest of the key>", "rps": 5.0, "burst": 10, "max_concurrent": 4}
    {"name": "batch", "sha256": "<hex digest>", "tpm": 60000, "priority": 5, "top_priority": 0, "weight": 0.5}

Only the SHA-256 of each key is stored: keys are 256 random bits (`KEY_PREFIX` + 43 URL-safe
characters), so a fast hash is enough (no password stretching needed) and the file is no
secret worth stealing. `rps`/`burst` (a token bucket) and `max_concurrent` are optional
per-key limits; absent means unlimited; `tpm` limits the tokens (prompt and completion) a
minute. For the router's admission queue a key may carry a default `priority` for requests
that name none, a `top_priority` (the most urgent a request may ask for; priorities follow
vLLM's convention, lower is more urgent) and a fair-share `weight` (default 1). Names are what logs, spans and metric labels show,
never the key. The router (`services.router.http.auth`) and the metrics collector read the same
format; `shared.api_keys_file` reads, writes and watches the file.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import re

import msgspec

KEY_PREFIX = "tdm_"
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_DIGEST = re.compile(r"[0-9a-f]{64}")


class KeyFileError(ValueError):
    """A key file that cannot be used, with the line and why."""


class ApiKey(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    name: str
    sha256: str
    rps: float | None = None  # sustained requests per second; None: unlimited
    burst: int | None = None  # bucket size; None: ceil(rps), at least 1
    max_concurrent: int | None = None  # requests in flight at once; None: unlimited
    tpm: int | None = None  # tokens (prompt and completion) per minute; None: unlimited
    priority: int | None = None  # the default priority of its requests; None: 0
    top_priority: int | None = None  # the most urgent priority its requests may ask for; None: any
    weight: float | None = None  # its fair share in the admission queue; None: 1

    @property
    def bucket_size(self) -> int:
        if self.burst is not None:
            return self.burst
        return max(1, math.ceil(self.rps or 1))

    def limits_text(self) -> str:
        parts = []
        if self.rps is not None:
            parts.append(f"{self.rps:g} req/s, burst {self.bucket_size}")
        if self.max_concurrent is not None:
            parts.append(f"{self.max_concurrent} concurrent")
        if self.tpm is not None:
            parts.append(f"{self.tpm} tokens/min")
        limits = ", ".join(parts) or "unlimited"
        return limits + self._admission_text()

    def _admission_text(self) -> str:
        parts = [f"{name} {value:g}" for name, value in (("priority", self.priority), ("top priority", self.top_priority),
                                                         ("weight", self.weight)) if value is not None]
        return f"; {', '.join(parts)}" if parts else ""


def key_problems(key: ApiKey) -> list[str]:
    problems = []
    if not NAME_PATTERN.fullmatch(key.name):
        problems.append(f"name {key.name!r}: 1-64 letters, digits, '_', '.', '-' (starting with a letter or digit)")
    if not _DIGEST.fullmatch(key.sha256):
        problems.append("sha256: 64 lower-case hex digits expected")
    if key.rps is not None and not (key.rps > 0 and math.isfinite(key.rps)):
        problems.append("rps must be positive")
    if key.burst is not None and (key.burst < 1 or key.rps is None):
        problems.append("burst must be at least 1, and needs rps")
    if key.max_concurrent is not None and key.max_concurrent < 1:
        problems.append("max_concurrent must be at least 1")
    if key.tpm is not None and key.tpm < 1:
        problems.append("tpm must be at least 1")
    if key.weight is not None and not (key.weight > 0 and math.isfinite(key.weight)):
        problems.append("weight must be positive")
    if key.priority is not None and key.top_priority is not None and key.priority < key.top_priority:
        problems.append("priority must not be more urgent (lower) than top_priority")
    return problems


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyTable:
    """The keys of one key file, looked up by the key a client presents."""

    def __init__(self, keys: tuple[ApiKey, ...] = ()) -> None:
        names = [key.name for key in keys]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        assert not duplicates, f"key names used twice: {duplicates}"
        self.keys = keys

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def names(self) -> list[str]:
        return [key.name for key in self.keys]

    def get(self, name: str) -> ApiKey | None:
        return next((key for key in self.keys if key.name == name), None)

    def lookup(self, presented: str) -> ApiKey | None:
        """The key whose hash matches `presented`, else None. Every entry is compared in
        constant time, and all of them are, so timing tells nothing about which matched."""
        digest = hash_key(presented)
        found = None
        for key in self.keys:
            if hmac.compare_digest(digest, key.sha256):
                found = key
        return found

    def with_key(self, key: ApiKey) -> KeyTable:
        return KeyTable((*(k for k in self.keys if k.name != key.name), key))

    def without(self, name: str) -> KeyTable:
        return KeyTable(tuple(k for k in self.keys if k.name != name))


_decoder = msgspec.json.Decoder(ApiKey)
_encoder = msgspec.json.Encoder()


def parse_key_file(text: str) -> KeyTable:
    """The table a key file's text holds; a `KeyFileError` naming the line if any is wrong."""
    keys: list[ApiKey] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            key = _decoder.decode(line)
        except msgspec.DecodeError as error:
            raise KeyFileError(f"line {number}: {error}") from None
        problems = key_problems(key)
        if any(key.name == seen.name for seen in keys):
            problems.append(f"name {key.name!r} is used twice")
        if any(key.sha256 == seen.sha256 for seen in keys):
            problems.append(f"key {key.name!r} has the same hash as another key")
        if problems:
            raise KeyFileError(f"line {number}: " + "; ".join(problems))
        keys.append(key)
    return KeyTable(tuple(keys))


def render_key_file(table: KeyTable) -> str:
    header = "# Tandem API keys: one JSON object a line; only hashes of keys (`tandem keys`)\n"
    return header + "".join(_encoder.encode(key).decode() + "\n" for key in table.keys)


def presented_key(authorization: str | None, *, basic: bool = False) -> str | None:
    """The key in an `Authorization` header value: `Bearer KEY`; with `basic`, also HTTP
    Basic with the key as password (what a browser's login prompt sends). None: no key."""
    if not authorization:
        return None
    scheme, _, credentials = authorization.strip().partition(" ")
    credentials = credentials.strip()
    if scheme.lower() == "bearer":
        return credentials or None
    if basic and scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(credentials, validate=True).decode()
        except (ValueError, UnicodeDecodeError):
            return None
        return decoded.partition(":")[2] or None
    return None
