"""Ending a room's own asyncio tasks: cancelled and waited for, so none outlives its owner's
`stop` and none leaves an unretrieved exception behind.

Callers: the services' `stop`s (the worker's loops and fleet ticker, the orchestrator's
watcher and command listener), the worker's request plane at a drain's deadline, and the
benchmarks' clients.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection


async def cancel_all(tasks: Collection[asyncio.Task]) -> None:
    """Cancel `tasks` and wait for them to end; what they raise (their cancellation too) is
    theirs, not the caller's."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def finish_within(tasks: Collection[asyncio.Task], timeout_s: float) -> None:
    """Wait for `tasks` up to `timeout_s`; cancel those still running and wait for them to end."""
    if not tasks:
        return
    _, still_running = await asyncio.wait(tasks, timeout=timeout_s)
    await cancel_all(still_running)
