"""How vLLM's model-worker ranks wait for the next step, on CPU hosts.

Between steps a rank waits on the engine's shared-memory queue (`shm_broadcast.MessageQueue`),
and vLLM's reader (`SpinCondition.wait`) spins there for a second after each message, then
waits on the queue's notification socket. On a GPU host that saves a wake-up per step. On a
CPU host the rank's core is the one it computes on, and the one its NIXL agent's progress
thread, its pulls and other engines' ranks share, and both of vLLM's ways of waiting were
seen to take that core whole on a 2-core host:
- the spin (`sched_yield` for a second after each message) starved a peer holder's
  progress thread until its reads timed out;
- the socket wait, now and then, stops sleeping: the reader's thread sits in `poll` at 100%
  of its core, nearly all of it in the kernel, for over a minute (seen in a prefill worker's rank
  and in a TP 2 decode worker's rank 0; `/proc/<tid>/syscall` says poll in every sample).
  Whatever shares the core gets nothing: a TP 2 decode rank bound to it stopped mid-pull
  (every thread runnable, no CPU time for 60 s; the kernel reported the core's workqueue
  stuck), so the request waited for its KV until the router gave up (the TP 2 stacks of `tests/vllm`,
  about half its runs). The socket also drops a notification now and then, which
  stalled streams for vLLM's 5 s recheck.

So where the platform is the CPU, a rank's reader waits on neither: it sleeps between
looks at the queue's flag, 50 us as it begins to wait (while decoding, the next step's
message follows within a few milliseconds) growing to 1 ms once it has waited 8 ms. A step
then starts an eighth of the gap late at most (against tens of milliseconds of CPU compute
per step), an idle rank wakes a thousand times a second (a few microseconds each), and
nothing a rank does between steps can take its core.

`quiet_rank_waits()` runs in each rank as vLLM imports Tandem's worker extension (before
the rank opens its queues, `multiproc_executor.WorkerProc`); it changes only the readers
created after it, and does nothing on other platforms or where vLLM's reader has another
shape (then vLLM's own wait stays, and the function says so).
"""

from __future__ import annotations

import functools
import logging
import time

log = logging.getLogger(__name__)

QUIET = "_tandem_quiet_waits"
WAITING, WAITING_SINCE = "_tandem_waiting_after", "_tandem_waiting_since"  # a reader's pause state
FIRST_PAUSE_S = 50e-6  # as a reader begins to wait
LONGEST_PAUSE_S = 1e-3  # once it has waited 8 x this
READER_FIELDS = ("is_reader", "last_read")  # what a pausing reader reads of vLLM's SpinCondition


def pause_seconds(waited_s: float, timeout_ms: int | None) -> float:
    """How long a reader that has waited `waited_s` since its last message sleeps: an eighth
    of that, within [FIRST_PAUSE_S, LONGEST_PAUSE_S] and the caller's timeout."""
    seconds = min(LONGEST_PAUSE_S, max(FIRST_PAUSE_S, waited_s / 8))
    return seconds if timeout_ms is None else min(seconds, max(timeout_ms, 0) / 1000)


def pause(condition, timeout_ms: int | None = None) -> None:
    """One wait of a rank's queue reader, in place of `SpinCondition.wait`; the caller
    (`MessageQueue.acquire_read`) then looks at the queue's flag again. The wait is timed
    from the first pause after a message (`last_read`): a rank reads a step's message at the
    step's start, so the time since then includes the step itself."""
    now = time.monotonic()
    if getattr(condition, WAITING, None) != condition.last_read:  # the first pause since the last message
        setattr(condition, WAITING, condition.last_read)
        setattr(condition, WAITING_SINCE, now)
    time.sleep(pause_seconds(now - getattr(condition, WAITING_SINCE), timeout_ms))


def quiet_rank_waits() -> bool:
    """Make vLLM's queue readers created in this process from now on pause instead of
    spinning or waiting on the notification socket, on CPU hosts; True where that is in force."""
    try:
        from vllm.distributed.device_communicators import shm_broadcast
        from vllm.platforms import current_platform
    except ImportError:
        return False
    condition = getattr(shm_broadcast, "SpinCondition", None)
    if condition is None or not current_platform.is_cpu():
        return False
    if getattr(condition, QUIET, False):
        return True
    if not callable(getattr(condition, "wait", None)) or not callable(getattr(condition, "record_read", None)):
        log.warning("vLLM's SpinCondition has another shape: its ranks wait as vLLM makes them")
        return False
    original = condition.__init__

    @functools.wraps(original)
    def init(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        if all(hasattr(self, name) for name in READER_FIELDS) and self.is_reader:
            self.wait = functools.partial(pause, self)

    condition.__init__ = init
    setattr(condition, QUIET, True)
    return True
