"""Waiting on a condition with a deadline: the one way tests wait, and never by sleeping.

`wait_for` (in a coroutine) polls a plain predicate or a coroutine function (e.g. one that
reads a service's `/health` or `/metrics` over HTTP); `wait_for_sync` (in plain code, a
subprocess or a thread) polls a plain predicate. Either returns the seconds it waited
once the condition holds, or raises AssertionError naming `what` it waited for once the
deadline passed. `what` may be a function, called only then, to describe the state at
that moment. A condition may itself raise AssertionError to fail at once (e.g. a process
that exited while the test waited for its output).

Helpers that wait for one particular thing (a worker idle, N records arrived) are thin
named functions over these two.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

Description = str | Callable[[], str]


async def wait_for(condition: Callable[[], bool | Awaitable[bool]], timeout_s: float = 5.0,
                   what: Description = "condition", *, interval_s: float = 0.01) -> float:
    started = time.monotonic()
    while True:
        met = condition()
        if inspect.isawaitable(met):
            met = await met
        if met:
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise AssertionError(_timed_out(timeout_s, what))
        await asyncio.sleep(interval_s)  # the poll interval


def wait_for_sync(condition: Callable[[], bool], timeout_s: float = 5.0, what: Description = "condition", *,
                  interval_s: float = 0.01) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(_timed_out(timeout_s, what))
        time.sleep(interval_s)  # the poll interval
    return time.monotonic() - started


def _timed_out(timeout_s: float, what: Description) -> str:
    return f"timed out after {timeout_s}s waiting for {what() if callable(what) else what}"
