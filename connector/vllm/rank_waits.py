"""How vLLM's model-worker ranks wait for the next step, on CPU hosts.

Between steps a rank waits on the engine's shared-memory queue, and vLLM keeps it spinning
there for a second after each message (`shm_broadcast.SpinCondition`, `busy_loop_s`): on a
GPU host that saves a wake-up per step. On a CPU host the rank's core is the one it
computes on, and the one its NIXL agent's progress thread, the engine core, the Tandem
worker and other engines' ranks share: measured on a 2-core host, a TP 2 worker's spinning
ranks starved a peer holder's progress thread until its reads timed out, and starved the
worker's own start for minutes. So where the platform is the CPU, the ranks wait on the
queue's notification socket from the first idle moment (`busy_loop_s` 0): a step then
costs one socket wake-up (tens of microseconds against milliseconds of CPU compute). The
socket may drop a notification (vLLM's publisher keeps one at most, for readers that
spin), so a waiting reader also looks at the queue every `RECHECK_MS` (vLLM's 5 s
recheck stalled a stream 5 s at a time: seen as a 5 s ITL p99 in `tandem bench serve`).

`quiet_rank_waits()` runs in each rank as vLLM imports Tandem's worker extension (before
the rank opens its queues, `multiproc_executor.WorkerProc`); it changes only the default
that vLLM's own queues use, and does nothing on other platforms or where vLLM's queue has
another shape (then vLLM's default stays, and the function says so).
"""

from __future__ import annotations

import functools
import inspect
import logging

log = logging.getLogger(__name__)

QUIET = "_tandem_quiet_waits"
RECHECK_MS = 10  # how often a waiting reader looks at the queue, notified or not


def quiet_rank_waits() -> bool:
    """Make vLLM's queue readers in this process wait without spinning, on CPU hosts; True
    where that is in force."""
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
    original = condition.__init__
    if "busy_loop_s" not in inspect.signature(original).parameters:
        log.warning("vLLM's SpinCondition takes no busy_loop_s: its ranks spin between steps")
        return False

    @functools.wraps(original)
    def init(self, *args, **kwargs) -> None:
        kwargs.setdefault("busy_loop_s", 0.0)
        original(self, *args, **kwargs)

    if not hasattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS"):
        log.warning("vLLM's queue has no SHM_READER_RECHECK_INTERVAL_MS: its ranks spin between steps")
        return False
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = RECHECK_MS
    condition.__init__ = init
    setattr(condition, QUIET, True)
    return True
