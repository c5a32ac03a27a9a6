"""Waiting on a condition with a deadline: tests never sleep to synchronise.

The condition is a plain predicate or a coroutine function (e.g. one that reads a
service's `/health` or `/metrics` over HTTP); either is polled until true or the deadline.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


async def wait_for(condition: Callable[[], bool | Awaitable[bool]], timeout_s: float = 5.0,
                   what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        met = condition()
        if inspect.isawaitable(met):
            met = await met
        if met:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.01)
