"""The request plane against a real nats-server: ordered frames, gaps, silence, no responders."""

from __future__ import annotations

import asyncio

import pytest

from shared.bus import Bus
from shared.codec import Codec, encode
from shared.config import BusConfig
from shared.errors import StreamGap, Timeout, Unavailable
from shared.frame_sender import FrameSender
from shared.request_plane import ResponseStream, open_stream
from shared.schemas import GenerateRequest, Tokens

requests: Codec[GenerateRequest] = Codec(GenerateRequest)


async def serve_once(bus: Bus, subject: str, behaviour: str) -> None:
    async def handler(msg) -> None:
        request = requests.decode(msg.data)
        sender = FrameSender(bus, msg.reply)
        await sender.accepted("w1")
        if behaviour == "silent":
            return
        if behaviour == "gap":
            await bus.client.publish(msg.reply, encode(Tokens(seq=5, token_ids=[1])))
            return
        for token in request.token_ids:
            await sender.tokens([token])
        await sender.finished("length", prompt_tokens=len(request.token_ids), cached_tokens=0,
                              completion_tokens=len(request.token_ids))

    await bus.client.subscribe(subject, cb=handler)


async def ends_with(stream: ResponseStream, error: type[Exception]) -> None:
    """Reading `stream` to its end raises `error`; the stream is closed after."""
    with pytest.raises(error):
        async for _ in stream.frames():
            pass
    await stream.close()


async def test_frames_arrive_in_order(bus: Bus, bus_config: BusConfig) -> None:
    subject = bus_config.subjects.generate("w1")
    await serve_once(bus, subject, "ok")
    stream = await open_stream(bus, subject, GenerateRequest(request_id="r", model="m", token_ids=[7, 8, 9]))
    got = [frame.token_ids[0] async for frame in stream.frames()]
    await stream.close()
    assert got == [7, 8, 9]
    assert stream.finished is not None and stream.finished.finish_reason == "length"


async def test_gap_is_an_error(bus: Bus, bus_config: BusConfig) -> None:
    subject = bus_config.subjects.generate("w1")
    await serve_once(bus, subject, "gap")
    stream = await open_stream(bus, subject, GenerateRequest(request_id="r", model="m", token_ids=[1]))
    await ends_with(stream, StreamGap)


async def test_silent_worker_is_a_timeout(bus: Bus, bus_config: BusConfig) -> None:
    subject = bus_config.subjects.generate("w1")
    await serve_once(bus, subject, "silent")
    stream = await open_stream(bus, subject, GenerateRequest(request_id="r", model="m", token_ids=[1]),
                               idle_timeout_s=0.3)
    await ends_with(stream, Timeout)


async def test_nobody_listening_is_unavailable(bus: Bus, bus_config: BusConfig) -> None:
    stream = await open_stream(bus, bus_config.subjects.generate("nobody"),
                               GenerateRequest(request_id="r", model="m", token_ids=[1]),
                               accept_timeout_s=0.3)
    await ends_with(stream, Unavailable)


async def test_abort_from_outside_ends_the_stream(bus: Bus, bus_config: BusConfig) -> None:
    from shared.errors import Disconnected

    subject = bus_config.subjects.generate("w1")
    await serve_once(bus, subject, "silent")
    stream = await open_stream(bus, subject, GenerateRequest(request_id="r", model="m", token_ids=[1]))
    asyncio.get_running_loop().call_later(0.1, stream.abort, Disconnected("worker w1 left"))
    await ends_with(stream, Disconnected)


async def _raw_frames(bus: Bus, inbox: str) -> asyncio.Queue:
    """Every frame sent to `inbox`, decoded, as it arrives."""
    from shared.schemas.generate import ResponseFrame

    frames: Codec[ResponseFrame] = Codec(ResponseFrame)
    arrived: asyncio.Queue = asyncio.Queue()

    async def collect(msg) -> None:
        arrived.put_nowait(frames.decode(msg.data))

    await bus.client.subscribe(inbox, cb=collect)
    return arrived


async def test_accepted_waits_for_the_next_frame_and_keeps_its_place(bus: Bus) -> None:
    from shared.schemas.generate import Accepted

    inbox = bus.client.new_inbox()
    arrived = await _raw_frames(bus, inbox)
    sender = FrameSender(bus, inbox, accept_hold_s=30.0)
    await sender.accepted("w1")
    await bus.client.flush()
    await asyncio.sleep(0.3)
    assert arrived.empty()  # held: nothing sent yet
    await sender.tokens([5])
    first = await asyncio.wait_for(arrived.get(), 5)
    second = await asyncio.wait_for(arrived.get(), 5)
    assert isinstance(first, Accepted) and (first.seq, first.worker_id) == (0, "w1")
    assert isinstance(second, Tokens) and (second.seq, second.token_ids) == (1, [5])


async def test_a_held_accepted_goes_alone_once_the_hold_is_over(bus: Bus) -> None:
    from shared.schemas.generate import Accepted

    inbox = bus.client.new_inbox()
    arrived = await _raw_frames(bus, inbox)
    sender = FrameSender(bus, inbox, accept_hold_s=0.05)
    await sender.accepted("w1")  # and nothing else: a long prefill
    frame = await asyncio.wait_for(arrived.get(), 5)
    assert isinstance(frame, Accepted) and frame.seq == 0
    await sender.failed("internal", "boom")  # the next frame follows it, numbered after it
    last = await asyncio.wait_for(arrived.get(), 5)
    assert last.seq == 1 and arrived.empty()


async def test_accepted_is_only_a_streams_first_frame(bus: Bus) -> None:
    sender = FrameSender(bus, bus.client.new_inbox())
    await sender.accepted("w1")
    with pytest.raises(RuntimeError, match="first frame"):
        await sender.accepted("w1")
    await sender.failed("internal", "boom")
