"""Encoder outputs kept in a directory that the workers of one model share: an image sent
again, in a later turn or to another worker, is loaded instead of encoded again.

Called by `connector.vllm.encoder_cache` (vLLM's encoder-cache connector contract): the
scheduler side asks `has`, the model runner side `read`s and `write`s. Pure file handling,
no vLLM import.

- Entries are keyed by the image's identifier (its content hash, set by the router) under
  a folder per model and model version: another model's encoder gives other outputs for
  the same image.
- Writes are atomic (a temporary file renamed into place): a reader in another worker
  sees a whole entry or none.
- The folder keeps at most `budget_bytes`: a write evicts the least recently used entries
  past it, but never one used in the last `grace_s` (the scheduler said it is there and
  the model runner is about to read it). `has` marks an entry used.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
SUFFIX = ".entry"


class EncoderStore:
    def __init__(self, root: str, namespace: str, *, budget_bytes: int, grace_s: float = 60.0,
                 clock: Callable[[], float] = time.time) -> None:
        if budget_bytes <= 0 or grace_s < 0:
            raise ValueError("the encoder store's budget must be positive and its grace not negative")
        self.folder = Path(root) / _file_name(namespace)
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.budget_bytes = budget_bytes
        self.grace_s = grace_s
        self._clock = clock

    def path(self, key: str) -> Path:
        return self.folder / (_file_name(key) + SUFFIX)

    def has(self, key: str) -> bool:
        """Whether `key` is stored; marks it used (eviction spares it for `grace_s`)."""
        now = self._clock()
        try:
            os.utime(self.path(key), (now, now))
        except FileNotFoundError:
            return False
        return True

    def write(self, key: str, save: Callable[[str], None]) -> None:
        """Store `key`: `save(path)` writes the entry to a temporary path, renamed into place."""
        with tempfile.NamedTemporaryFile(dir=self.folder, prefix=".writing.", delete=False) as tmp:
            tmp_name = tmp.name
        try:
            save(tmp_name)
            now = self._clock()
            os.utime(tmp_name, (now, now))
            os.replace(tmp_name, self.path(key))
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        self.evict()

    def evict(self) -> list[str]:
        """Remove the least recently used entries past the budget (none used within
        `grace_s`); the names removed."""
        entries = []
        for entry in os.scandir(self.folder):
            if entry.name.endswith(SUFFIX):
                try:
                    stat = entry.stat()
                except FileNotFoundError:  # another worker evicted it meanwhile
                    continue
                entries.append((stat.st_mtime, stat.st_size, entry.name))
        total = sum(size for _, size, _ in entries)
        removed = []
        oldest_allowed = self._clock() - self.grace_s
        for used, size, name in sorted(entries):
            if total <= self.budget_bytes or used > oldest_allowed:
                break
            (self.folder / name).unlink(missing_ok=True)
            total -= size
            removed.append(name)
        return removed


def _file_name(key: str) -> str:
    """`key` itself when it is a plain file name, else its SHA-256."""
    return key if _PLAIN_KEY.match(key) and not key.startswith(".") else hashlib.sha256(key.encode()).hexdigest()
