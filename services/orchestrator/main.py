"""Wiring for the orchestrator process: config in, membership service running until stopped.

The CLI / launcher builds an `OrchestratorConfig` and awaits `run_orchestrator`.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator

from services.orchestrator.service import OrchestratorService
from shared.bus import connect
from shared.config import OrchestratorConfig


async def run_orchestrator(config: OrchestratorConfig, *, ready: asyncio.Event | None = None) -> None:
    """Run until cancelled or SIGTERM; `ready` is set once the membership mirror is synced."""
    config.validate()
    bus = await connect(config.bus.nats_url, "tandem-orchestrator")
    service = OrchestratorService(config, bus)
    try:
        await service.start()
        if ready is not None:
            ready.set()
        with _stop_on_sigterm() as stopped:
            await stopped.wait()
    finally:
        await service.stop()
        await bus.close()


@contextlib.contextmanager
def _stop_on_sigterm() -> Iterator[asyncio.Event]:
    """An event set by SIGTERM, so a terminated process still cleans up and exits 0."""
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Signal handlers can only be installed from the main thread (not in embedded loops).
    installed = threading.current_thread() is threading.main_thread()
    if installed:
        loop.add_signal_handler(signal.SIGTERM, stopped.set)
    try:
        yield stopped
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGTERM)
