"""Waiting on a condition with a deadline: tests never sleep to synchronise."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.01)
