"""The router process's event loop: uvloop where it is installed (a dependency on Linux and
macOS), else asyncio's own. uvloop runs the router's callbacks, timers and socket I/O in C:
less CPU per request for the same behaviour. uvicorn picks httptools for HTTP parsing by
itself when it is installed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
