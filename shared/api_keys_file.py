"""The key file on disk (`shared.api_keys` is its format): read it, write it atomically with
mode 0600, make a new key, and watch it for changes without a restart.

`KeyFileWatcher.table(now)` is what a server asks on every request: at most once per
`check_interval_s` it compares the file's (inode, size, mtime) with what it last loaded,
a single `stat`; only a changed file is read again. A file rewritten with a key removed
revokes that key from the next check on. A file that disappears revokes every key; a file
that turns unreadable or malformed keeps the last good table (and logs why), so a broken
edit does not lock everyone out; an atomic rewrite (`write_key_file`) never shows a
half-written file.
"""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
from pathlib import Path

from shared.api_keys import KEY_PREFIX, KeyFileError, KeyTable, parse_key_file, render_key_file

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0


def new_key() -> str:
    """A fresh key: 256 random bits."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def read_key_file(path: str | Path) -> KeyTable:
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise KeyFileError(f"{path}: cannot read the API key file: {error.strerror}") from None
    try:
        return parse_key_file(text)
    except KeyFileError as error:
        raise KeyFileError(f"{path}: {error}") from None


def write_secret_file(path: str | Path, text: str) -> None:
    """Write `text` to `path` atomically (a temporary file in the same folder, renamed over
    it), readable by its owner only (0600) from the first byte on."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # created 0600
    try:
        with os.fdopen(descriptor, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_key_file(path: str | Path, table: KeyTable) -> None:
    write_secret_file(path, render_key_file(table))


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


class KeyFileWatcher:
    """The key table of one file, reloaded when the file changes. The clock is the caller's:
    `table(now)` with `now` from the server's monotonic clock."""

    def __init__(self, path: str | Path, *, check_interval_s: float = CHECK_INTERVAL_S) -> None:
        self.path = Path(path)
        self.check_interval_s = check_interval_s
        self._signature = _signature(self.path)
        self._table = read_key_file(self.path)  # a bad file at start is a KeyFileError: fail fast
        self._checked_at: float | None = None

    def table(self, now: float) -> KeyTable:
        if self._checked_at is not None and now - self._checked_at < self.check_interval_s:
            return self._table
        self._checked_at = now
        signature = _signature(self.path)
        if signature == self._signature:
            return self._table
        self._signature = signature
        if signature is None:
            log.warning("API key file %s is gone: every key is revoked until it is back", self.path)
            self._table = KeyTable()
            return self._table
        try:
            self._table = read_key_file(self.path)
        except KeyFileError as error:
            log.error("API key file changed but cannot be used; keeping the previous keys: %s", error)
        else:
            log.info("API key file %s reloaded: %d keys (%s)", self.path, len(self._table),
                     ", ".join(self._table.names) or "none")
        return self._table
