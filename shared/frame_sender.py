"""FrameSender: the worker's side of one streamed request on the request plane. The
contract it keeps with the caller (frames numbered from 0, never sent with a reply subject,
so that a message with one is a liveness probe) is stated in `shared.request_plane`, which
holds the caller's side.

Used by the worker's request plane and request runner (`services.worker.request_plane`,
`services.worker.request_runner`), its caller watch (`services.worker.caller_watch`) and the
KV session (`connector.kv_session`).
"""

from __future__ import annotations

import asyncio

import msgspec
from nats.errors import NoRespondersError

from shared.bus import Bus
from shared.codec import encode
from shared.schemas.generate import (
    ACCEPT_HOLD_S,
    Accepted,
    Failed,
    Finished,
    FinishReason,
    KvTarget,
    TokenLogprobs,
    Tokens,
)
from shared.schemas.transfer import KvHandle, PushTarget


class FrameSender:
    """The worker's side of one streamed request: numbers frames from 0.

    `Accepted` is held until the next frame, for at most `ACCEPT_HOLD_S`: a short request's
    acceptance and first tokens then go out in one NATS write, and the caller, nats-server
    and the worker each have one message less to wake up for. The caller's accept timeout
    must be longer than the hold (the router's config checks it)."""

    def __init__(self, bus: Bus, reply_subject: str, *, accept_hold_s: float = ACCEPT_HOLD_S) -> None:
        self._bus = bus
        self._reply = reply_subject
        self._seq = 0
        self._accept_hold_s = accept_hold_s
        self._held: bytes | None = None  # the encoded Accepted frame, not sent yet
        self._hold_timer: asyncio.TimerHandle | None = None
        self._release_task: asyncio.Task | None = None
        self.closed = False

    async def _send(self, frame: msgspec.Struct) -> None:
        if self.closed:
            raise RuntimeError("stream already ended")
        await self._send_held()
        await self._bus.client.publish(self._reply, encode(frame))
        self._seq += 1

    async def _send_held(self) -> None:
        held, self._held = self._held, None
        if held is None:
            return
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        # nats-py queues a publish before its first await: frames keep their order
        await self._bus.client.publish(self._reply, held)

    def _release_held(self) -> None:
        self._hold_timer = None
        if self._held is not None:
            self._release_task = asyncio.ensure_future(self._send_held_quietly())

    async def _send_held_quietly(self) -> None:
        try:
            await self._send_held()
        except Exception:
            pass  # NATS is going away: the caller's accept timeout reports the request

    async def caller_alive(self, timeout_s: float) -> bool | None:
        """Whether the caller's inbox still listens: True (it answered), False (NATS says
        nobody subscribes to it: the caller is gone), None (no answer in time: unknown)."""
        try:
            await self._bus.client.request(self._reply, b"", timeout=timeout_s)
        except NoRespondersError:
            return False
        except TimeoutError:
            return None
        return True

    async def accepted(self, worker_id: str) -> None:
        """Held: sent with the next frame, or alone once `accept_hold_s` has passed."""
        if self.closed or self._seq:
            raise RuntimeError("Accepted is a stream's first frame")
        self._held = encode(Accepted(seq=self._seq, worker_id=worker_id))
        self._seq += 1
        if self._accept_hold_s <= 0:
            await self._send_held()
            return
        self._hold_timer = asyncio.get_running_loop().call_later(self._accept_hold_s, self._release_held)

    async def kv_target(self, target: PushTarget) -> None:
        await self._send(KvTarget(seq=self._seq, target=target))

    async def tokens(self, token_ids: list[int], logprobs: list[TokenLogprobs] | None = None,
                     prompt_logprobs: list[TokenLogprobs | None] | None = None) -> None:
        await self._send(Tokens(seq=self._seq, token_ids=token_ids, logprobs=logprobs,
                                prompt_logprobs=prompt_logprobs))

    async def finished(self, finish_reason: FinishReason, *, prompt_tokens: int, cached_tokens: int,
                       completion_tokens: int, kv_handle: KvHandle | None = None, pulled_tokens: int = 0,
                       recomputed_tokens: int = 0) -> None:
        await self._send(Finished(seq=self._seq, finish_reason=finish_reason,
                                  prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                                  completion_tokens=completion_tokens, kv_handle=kv_handle,
                                  pulled_tokens=pulled_tokens, recomputed_tokens=recomputed_tokens))
        self.closed = True

    async def failed(self, code: str, message: str) -> None:
        await self._send(Failed(seq=self._seq, code=code, message=message))
        self.closed = True
