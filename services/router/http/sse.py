"""The streamed answer's hot path: SSE chunk bodies as bytes, the SSE response, and the one
watch per request that notices a client going away.

Chunks are spelled once per request as a byte prefix (id, object, created, model) to which
each chunk adds its choice, its text encoded by msgspec: no model object per token. The
JSON is the same as the response models in `protocol_answers` would give (same keys, same order).

`SseResponse` sends each chunk as one ASGI body message and the stream's last chunk with
`more_body=False`, so the end of the stream (final chunk, usage, `[DONE]`, end of the body)
is a single write. `DisconnectWatch` is a task per request that cancels the request's task
when the client disconnects (before or while streaming); the request absorbs that
cancellation (`absorb()`) and its cleanup still runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

_encode = msgspec.json.encode
SSE_DONE = b"data: [DONE]\n\n"


class ChunkPrefix:
    """`data: {"id":...,"object":...,"created":...,"model":...,"choices":[` for one request."""

    __slots__ = ("head",)

    def __init__(self, request_id: str, object_name: str, created: int, model: str) -> None:
        self.head = b"".join((b'data: {"id":', _encode(request_id), b',"object":', _encode(object_name),
                              b',"created":', str(created).encode(), b',"model":', _encode(model), b',"choices":['))

    def choice(self, choice_json: bytes, usage_json: bytes = b"null", extra_json: bytes = b"") -> bytes:
        """`extra_json`: more top-level members (`,"name":value`), after the usage."""
        return b"".join((self.head, choice_json, b'],"usage":', usage_json, extra_json, b"}\n\n"))

    def usage(self, usage_json: bytes) -> bytes:
        return b"".join((self.head, b'],"usage":', usage_json, b"}\n\n"))


class UsageSoFar:
    """One choice's chunks' own usage (`stream_options.continuous_usage_stats`): its prompt's
    tokens, and its completion tokens up to the chunk, as vLLM's server counts them
    (`protocol_answers.ChunkUsage`)."""

    __slots__ = ("prompt_tokens",)

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens

    def json(self, completion_tokens: int) -> bytes:
        prompt = self.prompt_tokens
        return b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}' % (
            prompt, completion_tokens, prompt + completion_tokens)


def text_json(text: str) -> bytes:
    return _encode(text)


def ids_member(name: str, token_ids: object) -> bytes:
    """`,"name":[...]`: a member of token ids to append to a JSON object."""
    return b"".join((b',"', name.encode(), b'":', _encode(token_ids)))


def finish_json(finish_reason: str | None) -> bytes:
    return b"null" if finish_reason is None else _encode(finish_reason)


class DisconnectWatch:
    """Cancels the task that created it when the client disconnects, until `stop()`."""

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None, "a DisconnectWatch belongs to a request's task"
        self._task = task
        self._active = True
        self.disconnected = False
        self._watcher: asyncio.Task[None] | None = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        self.disconnected = True
        if self._active:
            self._task.cancel()

    def absorb(self) -> bool:
        """After a `CancelledError` in the request's task: whether it was this watch's (then
        the task is no longer cancelled, and the request ends quietly)."""
        if self.disconnected and self._task.cancelling():
            self._task.uncancel()
            return True
        return False

    def stop(self) -> None:
        self._active = False
        # let go of the watching task: cancelled, it keeps its CancelledError, whose traceback
        # holds its frame, which holds this watch; were the watch still to hold the task, the
        # request's whole object graph would wait for the cyclic garbage collector
        watcher, self._watcher = self._watcher, None
        if watcher is not None and not watcher.done():
            watcher.cancel()


class SseResponse(Response):
    """An SSE stream of `(chunk, last)` pairs whose `on_close` runs however the stream ends
    (done, failed, client gone)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[tuple[bytes, bool]], on_close: Callable[[], Awaitable[None]],
                 watch: DisconnectWatch | None = None) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._on_close = on_close
        self.watch = watch  # the request's watch, handed over by the route; else one of its own

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = self.watch or DisconnectWatch(receive)
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            ended = False
            async for chunk, last in self._events:
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
                ended = last
            if not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not watch.absorb():
                raise
        finally:
            watch.stop()
            with anyio.CancelScope(shield=True):  # the client is gone; the worker must still hear it
                await self._on_close()
