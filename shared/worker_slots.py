"""Worker slots: a fixed set of worker ids made up front, each with its own NATS user, for
workers that learn their id only when they start (the replicas of a Docker Compose service).

A slot is a file `<id>.lock` in a directory the workers share (`make_slots`, called by
whoever made the slots' NATS users: `launch.compose_secrets`). A worker claims one by taking
an exclusive, non-blocking `fcntl.flock` on its file and keeps it for its lifetime
(`claim_slot`); the kernel lets go when the process ends, however it ends, so a restarted or
replacement container takes the slot again. `flock` locks belong to the open file, so two
claims in one process get two slots too. Workers never create a slot file: a slot exists
only if it was made, with its user.

Claiming is I/O (files and locks), the only I/O here; a refusal is a value (`SlotRefused`).
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass, field
from pathlib import Path

LOCK_SUFFIX = ".lock"
SLOT_PREFIX = "w"


def slot_ids(count: int) -> tuple[str, ...]:
    """The ids of `count` slots: `w01`, `w02`, ... (wider past 99), in claiming order."""
    width = max(2, len(str(count)))
    return tuple(f"{SLOT_PREFIX}{index:0{width}d}" for index in range(1, count + 1))


def make_slots(directory: str | Path, count: int) -> tuple[str, ...]:
    """Make the slot files of `count` slots in `directory` (kept when there) and remove those
    of slots past `count`: a worker holding one keeps it until it stops, nobody takes it again."""
    if count < 1:
        raise ValueError("at least one worker slot is needed")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ids = slot_ids(count)
    for slot in ids:
        (directory / f"{slot}{LOCK_SUFFIX}").touch(mode=0o600, exist_ok=True)
    for stale in set(listed_slots(directory)) - set(ids):
        (directory / f"{stale}{LOCK_SUFFIX}").unlink(missing_ok=True)
    return ids


def listed_slots(directory: str | Path) -> tuple[str, ...]:
    """The slots made in `directory`, in claiming order."""
    directory = Path(directory)
    if not directory.is_dir():
        return ()
    return tuple(sorted(path.name[:-len(LOCK_SUFFIX)] for path in directory.glob(f"*{LOCK_SUFFIX}")))


@dataclass(frozen=True, slots=True)
class SlotRefused:
    reason: str  # one line: what was asked, what is there, what to do


@dataclass(slots=True)
class SlotClaim:
    """A claimed slot: its worker id is this process's until `release` (or the process ends)."""

    worker_id: str
    path: Path
    _fd: int = field(repr=False)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the only descriptor drops the lock
            self._fd = -1

    def __enter__(self) -> SlotClaim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def claim_slot(directory: str | Path, wanted: str = "") -> SlotClaim | SlotRefused:
    """The first free slot in `directory` (or exactly `wanted`), locked for this process."""
    directory = Path(directory)
    slots = listed_slots(directory)
    if not slots:
        return SlotRefused(f"no worker slots in {directory}: they are made with the workers' NATS users "
                           f"(`tandem compose secrets`)")
    if wanted and wanted not in slots:
        return SlotRefused(f"no worker slot {wanted!r} in {directory} (slots: {_span(slots)})")
    for slot in [wanted] if wanted else slots:
        claim = _try_lock(directory / f"{slot}{LOCK_SUFFIX}", slot)
        if claim is not None:
            return claim
    if wanted:
        return SlotRefused(f"worker slot {wanted} in {directory} is held by another worker")
    return SlotRefused(f"all {len(slots)} worker slots in {directory} ({_span(slots)}) are held by other "
                       f"workers: make more (Docker Compose: TANDEM_WORKER_SLOTS=N docker compose up -d --force-recreate)")


def _try_lock(path: Path, slot: str) -> SlotClaim | None:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)  # never O_CREAT: only made slots exist
    except FileNotFoundError:
        return None  # removed since it was listed
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    if not _still_there(fd, path):  # removed (slots made fewer) between open and lock
        os.close(fd)
        return None
    return SlotClaim(worker_id=slot, path=path, _fd=fd)


def _still_there(fd: int, path: Path) -> bool:
    try:
        current = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (current.st_dev, current.st_ino)


def _span(slots: tuple[str, ...]) -> str:
    return slots[0] if len(slots) == 1 else f"{slots[0]}..{slots[-1]}"
