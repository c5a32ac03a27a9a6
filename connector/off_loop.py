"""Running a blocking transfer off the event loop without letting cancellation free its blocks
early: shared by the transports that copy on their own threads (`connector.nixl_agent`,
`connector.memory_transport`).
"""

from __future__ import annotations

import asyncio
import threading
from typing import TypeVar

T = TypeVar("T")


async def await_transfer(future: asyncio.Future[T], cancel: threading.Event) -> T:
    """The transfer's result. If the caller is cancelled, `cancel` is set and the wait goes
    on until the copy has stopped (bounded by the transfer's own timeout) before the
    cancellation propagates: a caller that frees the blocks on cancellation must not find
    them still being written."""
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        cancel.set()
        while not future.done():
            try:
                await asyncio.wait({future})
            except asyncio.CancelledError:
                continue
        raise
