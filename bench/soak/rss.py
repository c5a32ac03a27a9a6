"""Resident memory of the stack's processes, read from /proc (Linux).

A process's figure includes its descendants (a vLLM worker's engine processes); a process
that is gone reads as None. `RssSampler` keeps (seconds since start, bytes) per process.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def _children(pid_parents: dict[int, int], root: int) -> list[int]:
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        kids = [pid for pid, ppid in pid_parents.items() if ppid == parent]
        found += kids
        frontier += kids
    return found


def _parents() -> dict[int, int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return parents


def rss_bytes(pid: int) -> int | None:
    """Resident bytes of one process (not its children); None when it is gone."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None


def tree_rss_bytes(pid: int, parents: dict[int, int] | None = None) -> int | None:
    own = rss_bytes(pid)
    if own is None:
        return None
    return own + sum(rss_bytes(child) or 0 for child in _children(parents or _parents(), pid))


class RssSampler:
    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.started = time.monotonic()
        self.samples: dict[str, list[tuple[float, int]]] = {name: [] for name in pids}

    def sample(self) -> dict[str, int | None]:
        """One reading of every process; those alive are recorded."""
        at = time.monotonic() - self.started
        parents = _parents()
        reading = {name: tree_rss_bytes(pid, parents) for name, pid in self.pids.items()}
        for name, value in reading.items():
            if value is not None:
                self.samples[name].append((at, value))
        return reading
