"""A worker's whole answer to one request, read straight off the request plane (no router):
what the worker-level tests compare."""

from __future__ import annotations

import msgspec

from shared.bus import Bus
from shared.request_plane import open_stream
from shared.schemas import Finished


async def whole_answer(bus: Bus, subject: str, request: msgspec.Struct) -> tuple[list[int], Finished]:
    """The tokens the worker on `subject` streams for `request`, and its `Finished` frame."""
    stream = await open_stream(bus, subject, request)
    try:
        tokens = [t async for frame in stream.frames() for t in frame.token_ids]
    finally:
        await stream.close()
    assert stream.finished is not None
    return tokens, stream.finished
