"""Wiring for the orchestrator process: config in, membership service running until stopped.

The CLI / launcher builds an `OrchestratorConfig` and awaits `run_orchestrator`.
"""

from __future__ import annotations

import asyncio

from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.service import OrchestratorService
from shared.bus import connect
from shared.lifecycle import serve_until_signalled


async def run_orchestrator(config: OrchestratorConfig, *, ready: asyncio.Event | None = None) -> None:
    """Run until cancelled or SIGTERM; `ready` is set once the membership mirror is synced."""
    config.validate()
    bus = await connect(config.bus, "tandem-orchestrator")
    service = OrchestratorService(config, bus)
    try:
        await service.start()
        await serve_until_signalled(ready)
    finally:
        await service.stop()
        await bus.close()
