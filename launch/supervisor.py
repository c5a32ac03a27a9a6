"""`tandem up`'s watch over its workers: a worker process that exits on its own is started
again after a backoff, within bounds (`launch.restart_policy` decides), and every exit,
restart and give-up is said on the console. The restarted worker is told how often it was
restarted and how its predecessor ended (`--restarts`, `--last-exit`): it registers both,
so `tandem status` and the cluster page show them.

`tick()` is called from `tandem up`'s foreground loop; it never blocks on a worker's start.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from launch.restart_policy import GiveUp, Restart, RestartLedger, RestartPolicy, exit_reason
from launch.stack import LocalStack

SUPERVISE_POLL_S = 0.5


def last_error_line(log_tail: str) -> str:
    """The process's own last word: its last "error: ..." line ("" when it said none, as
    after SIGKILL)."""
    errors = [line.strip() for line in log_tail.splitlines() if line.strip().startswith("error:")]
    return errors[-1].removeprefix("error: ")[:300] if errors else ""


class WorkerSupervisor:
    def __init__(self, stack: LocalStack, say: Callable[[str], None], policy: RestartPolicy = RestartPolicy(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._stack = stack
        self._say = say
        self._clock = clock
        self._ledger = RestartLedger(policy)
        self._pending: dict[str, Restart] = {}  # worker id -> its restart, not yet due
        self.given_up: dict[str, str] = {}  # worker id -> why
        self.restarts: dict[str, int] = {}  # worker id -> restarts so far

    def tick(self) -> None:
        now = self._clock()
        for spec in self._stack.config.workers:
            worker_id = spec.worker_id
            if worker_id in self.given_up:
                continue
            restart = self._pending.get(worker_id)
            if restart is not None:
                if now >= restart.at:
                    del self._pending[worker_id]
                    self.restarts[worker_id] = self.restarts.get(worker_id, 0) + 1
                    self._stack.start_worker(spec, restarts=self.restarts[worker_id], last_exit=restart.reason)
                    self._say(f"worker {worker_id} started again (restart {self.restarts[worker_id]})")
                continue
            process = self._stack.processes.get(worker_id)
            if process is None or process.alive:
                continue
            process.kill_leftovers()  # a dead worker's engine processes
            if process.popen.returncode == 0:  # drained, or stopped on purpose: not a failure
                self.given_up[worker_id] = "it exited normally"
                self._say(f"worker {worker_id} exited normally; not restarting it")
                continue
            reason = exit_reason(process.popen.returncode, last_error_line(process.log_tail(40)))
            match self._ledger.on_exit(worker_id, reason, now):
                case GiveUp(reason=why):
                    self.given_up[worker_id] = why
                    self._say(f"giving up on worker {worker_id}: {why}; its log: {process.log_path}")
                case Restart() as restart:
                    self._pending[worker_id] = restart
                    self._say(f"worker {worker_id} exited ({reason}); starting it again in "
                              f"{restart.at - now:.0f} s")
