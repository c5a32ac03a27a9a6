"""What the router accepts as a request body before FastAPI parses it (ASGI middleware).

- Content type: a JSON body is read as JSON whatever the client called it when it named
  no type, or the types `curl -d` and plain clients send (`application/x-www-form-urlencoded`,
  `text/plain`), as OpenAI's API does (vLLM refuses them with a 400); any other non-JSON type
  (multipart, XML, ...) is a 415 naming what is accepted.
- Size: a body over `max_body_bytes` is a 413, refused from its `Content-Length` before it is
  read, or as soon as a body sent without one passes the limit.
- Depth: a JSON body nested deeper than `MAX_JSON_DEPTH` arrays or objects is a 400 before
  any parser recurses into it (no request field nests more than a few levels).
- Encoding: a body that is not valid UTF-8 (JSON's one encoding, RFC 8259), in a key or a
  value alike, is a 400 naming the first bad byte; the JSON parsers would raise
  `UnicodeDecodeError`, which no handler expects.

Every refusal is an OpenAI error body. `create_app` installs `InputGuard` outermost but
for tracing.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_JSON_DEPTH = 64
_READ_AS_JSON = frozenset({"", "application/x-www-form-urlencoded", "text/plain"})
_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})


def json_depth_exceeds(body: bytes, limit: int) -> bool:
    """Whether `body` nests arrays/objects deeper than `limit` (brackets inside strings do not count)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False  # too few brackets to nest that deep: no scan
    depth = 0
    in_string = escaped = False
    for byte in body:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # closing quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                return True
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return False


def utf8_error(body: bytes | bytearray) -> str | None:
    """Why `body` is not valid UTF-8 (a lone continuation byte, a truncated or overlong
    sequence, an encoded surrogate, 0xFF, ...), or None when it is."""
    if body.isascii():
        return None  # nearly every body: no decoding needed
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as error:
        return f"the request body is not valid UTF-8: {error.reason} at byte {error.start} ({body[error.start]:#04x})"
    return None


def _error_body(message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()


async def _answer(send: Send, status: int, message: str, code: str) -> None:
    body = _error_body(message, code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class InputGuard:
    def __init__(self, app: ASGIApp, *, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _WITH_BODY:
            await self.app(scope, receive, send)
            return
        headers = [(name, value) for name, value in scope["headers"] if name != b"content-type"]
        content_type = next((value for name, value in scope["headers"] if name == b"content-type"), b"")
        media_type = content_type.decode("latin-1").split(";", 1)[0].strip().lower()
        if media_type in _READ_AS_JSON:
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        elif not (media_type == "application/json" or media_type.endswith("+json")):
            await _answer(send, 415, f"Unsupported Media Type {media_type!r}: send the request as "
                                     "application/json", "unsupported_media_type")
            return
        length = next((value for name, value in scope["headers"] if name == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _answer(send, 413, f"the request body is larger than {self.max_body_bytes} bytes",
                          "request_too_large")
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body.extend(message.get("body", b""))
            if len(body) > self.max_body_bytes:
                await _answer(send, 413, f"the request body is larger than {self.max_body_bytes} bytes",
                              "request_too_large")
                return
            if not message.get("more_body", False):
                break
        if json_depth_exceeds(body, MAX_JSON_DEPTH):
            await _answer(send, 400, f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels", "invalid_argument")
            return
        not_utf8 = utf8_error(body)
        if not_utf8 is not None:
            await _answer(send, 400, not_utf8, "invalid_argument")
            return
        await self.app(scope, replay_body(bytes(body), receive), send)


def replay_body(body: bytes, receive: Receive) -> Receive:
    """The body, already read, as one message; then whatever the client sends (a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
