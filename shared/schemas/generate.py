"""Request plane: a generate request and the frames streamed back to the caller.

The worker answers on the request's reply inbox with frames numbered by `seq` from 0:
`Accepted` first, then `Tokens`... (a push-mode decode worker sends one `KvTarget`
before them), and exactly one terminal frame, `Finished` or
`Failed`. A caller that sees a gap in `seq`, or hears nothing for its idle timeout,
ends the request with an explicit error (see `shared.request_plane`).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from shared.schemas.common import Message
from shared.schemas.transfer import KvHandle, KvTransferParams, PushTarget

FinishReason = Literal["stop", "length", "abort", "cache_threshold"]


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True):
    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False


class GenerateRequest(Message, tag="generate", kw_only=True):
    request_id: str
    model: str
    token_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    kv_transfer: KvTransferParams | None = None
    # W3C trace context travels in NATS headers, not here.


class Accepted(Message, tag="accepted", kw_only=True):
    seq: int
    worker_id: str


class Tokens(Message, tag="tokens", kw_only=True):
    seq: int
    token_ids: list[int]


class Finished(Message, tag="finished", kw_only=True):
    seq: int
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    kv_handle: KvHandle | None = None  # prefill with `hold_for_decode`: the leased blocks
    pulled_tokens: int = 0  # prompt tokens whose KV arrived from another worker
    recomputed_tokens: int = 0  # tokens meant to arrive that had to be computed


class KvTarget(Message, tag="kv_target", kw_only=True):
    """Decode worker with `await_push`: the blocks it allocated for the writer."""

    seq: int
    target: PushTarget


class Failed(Message, tag="failed", kw_only=True):
    seq: int
    code: str
    message: str


ResponseFrame = Accepted | Tokens | KvTarget | Finished | Failed
