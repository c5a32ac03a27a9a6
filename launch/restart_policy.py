"""When a worker that exited on its own is started again (pure; `launch.supervisor` acts).

A worker process that exits while the stack runs (its engine died: exit 3; killed; out of
memory) is restarted after a backoff that doubles with each exit inside the window
(1 s, 2 s, 4 s ... capped), at most `max_restarts` times inside the window; one more exit
and the launcher gives up on that worker, saying why. Exits older than the window are
forgotten, so a worker that crashes once a day is restarted every time.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    max_restarts: int = 5  # within `window_s`; then give up
    window_s: float = 600.0
    first_backoff_s: float = 1.0
    max_backoff_s: float = 30.0


@dataclass(frozen=True, slots=True)
class Restart:
    at: float  # when to start it again (the caller's clock)
    attempt: int  # 1 for the first restart inside the window
    reason: str  # how it exited


@dataclass(frozen=True, slots=True)
class GiveUp:
    reason: str


def exit_reason(returncode: int, last_error: str = "") -> str:
    """How a process ended, for people: "exit 3: <its last error line>", "killed by SIGKILL"."""
    if returncode < 0:
        try:
            how = f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"killed by signal {-returncode}"
    else:
        how = f"exit {returncode}"
    return f"{how}: {last_error}" if last_error else how


@dataclass
class RestartLedger:
    """Each worker's recent exits, and what to do about a new one."""

    policy: RestartPolicy = field(default_factory=RestartPolicy)
    _exits: dict[str, list[float]] = field(default_factory=dict)

    def on_exit(self, worker_id: str, reason: str, now: float) -> Restart | GiveUp:
        recent = [at for at in self._exits.get(worker_id, []) if now - at < self.policy.window_s]
        recent.append(now)
        self._exits[worker_id] = recent
        if len(recent) > self.policy.max_restarts:
            return GiveUp(f"{worker_id} exited {len(recent)} times within {self.policy.window_s:g} s "
                          f"(last: {reason}); not restarting it again")
        backoff = min(self.policy.first_backoff_s * 2 ** (len(recent) - 1), self.policy.max_backoff_s)
        return Restart(at=now + backoff, attempt=len(recent), reason=reason)
