"""Process lifecycle helpers shared by the services' `main` modules."""

from __future__ import annotations

import asyncio
import contextlib
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
