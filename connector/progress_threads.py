"""NIXL's progress threads may run on any core the worker may use, whatever core the thread
that started them is bound to.

NIXL's UCX backend starts its progress thread as the first backend is created
(`KvAgent.register_pool`), and a thread starts with its creator's CPU affinity. In a vLLM
rank on a CPU host that is the rank's own core (`--vllm-cpu-threads-bind`, vLLM binds the
rank's main thread to it), which on a small host is also another engine's core. The thread
spins while its worker has work in flight (`progressLoop` until `arm()` stops answering
busy), which a connection to a peer that is itself starved of CPU never stops: seen on a
2-core host, a prefill rank's progress thread held its core at 98% for a minute while the TP 2
decode rank bound to the same core, mid-way through connecting to it for its first read,
got no CPU time at all, until the router gave up on the request (`tests/vllm/test_vllm_shapes.py`). Free
to run on any core, the spinning thread leaves the bound rank its core, the connection
completes and the spin ends.

`released_from_binding()` wraps the call that starts the threads; it does nothing where the
caller is not bound more narrowly than the process may run, or off Linux. What the worker may
run on is what a vLLM worker writes in `WORKER_CPUS` for its engine's processes (which it
starts on the engine's own cores), else the cores of the process that started this one.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

log = logging.getLogger(__name__)

TASKS = "/proc/self/task"
WORKER_CPUS = "TANDEM_WORKER_CPUS"  # "0,1,...": the cores the worker that started the engine may use


def unbound_cpus() -> set[int]:
    """What an operator's own binding of the whole worker allows: the worker's cores where it
    named them (`WORKER_CPUS`), else those of the process that started this one."""
    if named := os.environ.get(WORKER_CPUS, ""):
        return {int(core) for core in named.split(",")}
    try:
        return os.sched_getaffinity(os.getppid())
    except OSError:  # the parent is gone: the machine's cores (the kernel keeps the allowed ones)
        return set(range(os.cpu_count() or 1))


def thread_ids() -> set[int]:
    try:
        return {int(name) for name in os.listdir(TASKS)}
    except OSError:
        return set()


@contextlib.contextmanager
def released_from_binding() -> Iterator[None]:
    """Threads started inside the block may run on the cores of the parent process, where the
    calling thread is bound to fewer."""
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    bound = os.sched_getaffinity(0)
    cpus = unbound_cpus() | bound
    before = thread_ids()
    yield
    if bound >= cpus:
        return
    for tid in sorted(thread_ids() - before):
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError as error:  # it ended already, or the cgroup allows none of them
            log.debug("thread %d keeps its binding: %s", tid, error)
            continue
        log.info("NIXL thread %d may run on cores %s (its creator is bound to %s)", tid,
                 ",".join(map(str, sorted(os.sched_getaffinity(tid)))), ",".join(map(str, sorted(bound))))
