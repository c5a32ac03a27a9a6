"""The disaggregated flow in push mode (`--pd-transfer push`): a `TokenSource` made of two
worker parts, the decode worker asked first.

1. `open()` sends the decode worker the prompt with `max_tokens - 1` and `await_push`: it
   allocates blocks for the prompt's KV, answers with a `KvTarget` frame, and waits
   (bounded, on its side) for the writer's `PushDone`, which carries the first token.
2. On that target, the prefill worker gets the prompt with `max_tokens=1` and `push_to`:
   it writes each layer's blocks into the decode worker's as it computes them, streams
   the first token (yielded at once: the client sees it from the prefill worker), and
   sends `PushDone`.
3. The decode worker commits the blocks that verified, recomputes the others, and
   streams the remaining tokens. The request's `Finished` merges both parts' as in pull
   mode (`merged_finished`).

There is no lease: the blocks are the decode worker's from the start. Waiting for the
`KvTarget` and sending the prefill request happen at the start of `frames()` rather than
in `open()`, so that a decode worker that never accepts, refuses, or leaves before the
first token fails the request the way any first-token failure does: `Generation` retries
it on another worker when that worker was lost.

Failures of either part surface as its `TandemError`; `failed_worker_id` names the worker
at fault. When the prefill part fails, the decode part is cancelled at once (its worker
would also stop waiting on the `PushDone(failed)` the prefill worker sends, or on its own
bound). Each part has its own in-flight slot and child span, ended exactly once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from opentelemetry import trace

from services.router.disaggregated import TwoPartStream, child_span, end_span, merged_finished, span_headers
from services.router.records import OUTCOME_OK, GenerationParams
from services.router.token_source import WorkerPart
from services.router.worker_link import WorkerLink
from services.router.worker_pool import InFlight
from shared.errors import ErrorCode, TandemError
from shared.schemas import GenerateRequest, Tokens
from shared.schemas.transfer import KvTransferParams, PushTarget


class PushedDisaggregatedStream(TwoPartStream):
    """Decode part (allocating), prefill part (pushing), read by `Generation` as one stream."""

    def __init__(self, *, params: GenerationParams, link: WorkerLink, prefill: InFlight, decode: InFlight,
                 span: trace.Span) -> None:
        assert params.sampling.max_tokens > 1, "push mode needs a decode part"
        super().__init__(params, span, WorkerPart(link, prefill, params.request_id))
        self._decode = WorkerPart(link, decode, params.request_id)
        self._decode_span = child_span("router.decode", span, decode.worker_id)
        self._prefill_sent = False
        self._decode_cancelled = False

    @property
    def worker_id(self) -> str:
        return self._decode.worker_id if self._prefill.finished is not None else self._prefill.worker_id

    async def open(self) -> None:
        """Send the decode request; raises `Unavailable` if it could not be sent."""
        params = self._params
        sampling = msgspec.structs.replace(params.sampling, max_tokens=params.sampling.max_tokens - 1)
        request = GenerateRequest(request_id=params.request_id, model=params.model, token_ids=params.prompt_ids,
                                  sampling=sampling, kv_transfer=KvTransferParams(await_push=True))
        await self._decode.send(request, span_headers(self._decode_span))

    async def frames(self) -> AsyncIterator[Tokens]:
        # No cleanup here (the generator may be abandoned at any yield): `close()` does it all.
        try:
            target = await self._decode.kv_target()  # bounded by the request plane's accept/idle timeouts
        except TandemError as error:
            self._fail(self._decode, self._decode_span, error)
            raise
        self._decode_span.set_attribute("tandem.kv.push_blocks", len(target.block_ids))
        try:
            await self._send_prefill(target)
            async for frame in self._prefill.frames():
                self._take_first_token(frame)
                yield frame
        except TandemError as error:
            self._fail(self._prefill, self._prefill_span, error)
            await self._cancel_decode()  # no push is coming: do not leave its worker waiting
            raise
        prefill_done = self._prefill.finished
        assert prefill_done is not None
        end_span(self._prefill_span, OUTCOME_OK)
        await self._prefill.close()  # its in-flight slot is free from now on
        if len(self._first_token_ids) != 1:  # ended without a token (aborted): its push carried none
            await self._cancel_decode()
            self._finished = prefill_done
            return
        # A stop token as the first token is the decode worker's to see (it ends with "stop").
        try:
            async for frame in self._decode.frames():
                yield frame
        except TandemError as error:
            self._fail(self._decode, self._decode_span, error)
            raise
        decode_done = self._decode.finished
        assert decode_done is not None
        self._finished = merged_finished(self._params, prefill_done, len(self._first_token_ids), decode_done,
                                         (self._decode_span, self._span))
        end_span(self._decode_span, OUTCOME_OK)

    async def _send_prefill(self, target: PushTarget) -> None:
        params = self._params
        request = GenerateRequest(request_id=params.request_id, model=params.model, token_ids=params.prompt_ids,
                                  sampling=msgspec.structs.replace(params.sampling, max_tokens=1),
                                  kv_transfer=KvTransferParams(push_to=target))
        self._prefill_sent = True  # from here on the prefill worker may be working on it
        await self._prefill.send(request, span_headers(self._prefill_span))

    def _fail(self, part: WorkerPart, span: trace.Span, error: TandemError) -> None:
        self._failed_worker_id = part.worker_id
        end_span(span, error.code.value)

    async def _cancel_decode(self) -> None:
        if not self._decode_cancelled and self._decode.finished is None:
            self._decode_cancelled = True
            await self._decode.cancel()

    async def cancel(self) -> None:
        if self._prefill_sent and self._prefill.finished is None:
            await self._prefill.cancel()
        await self._cancel_decode()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._prefill.close()
        finally:
            try:
                await self._decode.close()
            finally:
                end_span(self._prefill_span, ErrorCode.CANCELLED.value)  # no-ops for parts that ended
                end_span(self._decode_span, ErrorCode.CANCELLED.value)
