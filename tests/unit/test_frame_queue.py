"""A stream's frame queue: arrivals read in order, a wait that ends with the next arrival or
its timeout, and a reader cancelled while waiting that leaves the queue usable."""

from __future__ import annotations

import asyncio

import pytest

from shared.errors import Disconnected
from shared.request_plane import FrameQueue


async def test_arrivals_are_read_in_order_without_waiting() -> None:
    queue = FrameQueue()
    error = Disconnected("gone")
    for item in ("a", "b", error):
        queue.put(item)  # type: ignore[arg-type]
    assert not queue.empty()
    assert [await queue.get(0.0), await queue.get(0.0), await queue.get(0.0)] == ["a", "b", error]
    assert queue.empty()


async def test_a_waiting_reader_gets_the_next_arrival() -> None:
    queue = FrameQueue()
    reading = asyncio.ensure_future(queue.get(5.0))
    await asyncio.sleep(0)
    assert not reading.done()
    queue.put("a")  # type: ignore[arg-type]
    queue.put("b")  # type: ignore[arg-type]
    assert await reading == "a"
    assert await queue.get(5.0) == "b"


async def test_a_wait_with_no_arrival_times_out() -> None:
    queue = FrameQueue()
    with pytest.raises(TimeoutError):
        await queue.get(0.01)
    queue.put("late")  # type: ignore[arg-type]
    assert await queue.get(0.01) == "late"


async def test_a_reader_cancelled_while_waiting_leaves_the_queue_usable() -> None:
    queue = FrameQueue()
    reading = asyncio.ensure_future(queue.get(5.0))
    await asyncio.sleep(0)
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    queue.put("a")  # type: ignore[arg-type]
    assert await queue.get(5.0) == "a"


async def test_a_reader_cancelled_after_its_timeout_fired_leaves_nothing_unread() -> None:
    queue = FrameQueue()
    reading = asyncio.ensure_future(queue.get(0.0))
    await asyncio.sleep(0)  # waiting, its timer due at once
    await asyncio.sleep(0.01)  # the timer fired: the wait ended with TimeoutError, not yet read
    reading.cancel()
    with pytest.raises((asyncio.CancelledError, TimeoutError)):
        await reading
    queue.put("a")  # type: ignore[arg-type]
    assert await queue.get(5.0) == "a"
