"""Process lifecycle helpers shared by the services' `main` modules."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def stop_on_signals(signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)) -> Iterator[asyncio.Event]:
    """An event set by SIGTERM/SIGINT, so a stopped process still cleans up and exits 0."""
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Signal handlers can only be installed from the main thread (not in embedded loops).
    installed = threading.current_thread() is threading.main_thread()
    if installed:
        for sig in signals:
            loop.add_signal_handler(sig, stopped.set)
    try:
        yield stopped
    finally:
        if installed:
            for sig in signals:
                loop.remove_signal_handler(sig)


async def serve_until_signalled(ready: asyncio.Event | None = None) -> None:
    """Tell `ready` (where a caller waits for it) that the service is up, then wait for
    SIGTERM/SIGINT; the caller's cleanup runs after."""
    if ready is not None:
        ready.set()
    with stop_on_signals() as stopped:
        await stopped.wait()


def reraise_if_cancelling(error: BaseException | None = None) -> None:
    """In a periodic or retry loop: raise `CancelledError` if this task was asked to stop.

    A cancellation can get lost inside a library call: turned into another error (nats-py
    reports a cancelled request as a timeout) or swallowed outright (Python 3.11's
    `asyncio.wait_for` drops it when the inner call finishes at the same moment). A loop
    that checks after each call still stops instead of running for ever."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError from error


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child, before exec (`preexec_fn`): SIGTERM this process when its parent dies, so
    a launcher killed with SIGKILL leaves no orphans. Linux only; elsewhere a no-op."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
