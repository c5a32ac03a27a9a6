"""The two-part flow of a disaggregated plan (XpYd): a `TokenSource` made of a prefill part
and, unless one token is all the client asked for, a decode part. The plan's `HandOff`
(`services.router.flows.handoff`: pull or push) says which part is asked first and with what.

The prefill part streams exactly one token, yielded the moment it arrives: the client sees
it before the decode part has produced anything. The request's `Finished` merges both
parts' (the KV hand-off figures are the decode worker's).

- Pull (prefill first): `open()` sends the prefill request; once it ended with a lease the
  decode request follows. From the prefill's `Finished` until the decode request ends in
  `Finished`, the lease is this router's to release: whenever the request ends otherwise
  (client gone, decode refused, failed, or removed, or no decode needed), `close()` sends
  `LeaseRelease(cancelled)` to the holder at once rather than leaving the blocks pinned
  until the TTL. A decode worker that also released it makes that a harmless no-op.
- Push (decode first): `open()` sends the decode request. Waiting for its `KvTarget` and
  sending the prefill request happen at the start of `frames()` rather than in `open()`,
  so that a decode worker that never accepts, refuses, or leaves before the first token
  fails the request the way any first-token failure does. When the prefill part fails (or
  ends without a token), the decode part is cancelled at once (its worker would also stop
  waiting on the `PushDone(failed)` the prefill worker sends, or on its own bound).

Each part has its own in-flight slot (ended as soon as that part ends) and its own child
span of the router span, whose context travels to that worker in the NATS headers, ended
exactly once. Failures of either part surface as the part's `TandemError`, and
`failed_worker_id` names the worker at fault: `Generation` resumes the request elsewhere
when that worker was lost, or turns the error into an HTTP error (before the first byte)
or an SSE error event (after), never a truncated 200.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import msgspec
from opentelemetry import trace

from services.router.fleet.worker_link import WorkerLink
from services.router.fleet.worker_state import InFlight
from services.router.flows.handoff import HandOff
from services.router.flows.records import OUTCOME_OK, GenerationParams
from services.router.flows.spans import child_span, end_span, span_headers
from services.router.flows.token_source import WorkerPart
from services.router.metrics import RouterMetrics
from shared.errors import ErrorCode, TandemError
from shared.schemas import Finished, GenerateRequest, Tokens
from shared.schemas.transfer import KvHandle, PushTarget

log = logging.getLogger(__name__)


def merged_finished(params: GenerationParams, prefill_done: Finished, first_tokens: int, decode_done: Finished,
                    spans: tuple[trace.Span, ...]) -> Finished:
    """The request's `Finished` from its two parts' (the KV hand-off figures are the decode
    worker's), recording those figures on `spans`."""
    for span in spans:
        if span.is_recording():  # a resumed request's `router.resume` span has ended already
            span.set_attribute("tandem.pulled_tokens", decode_done.pulled_tokens)
            span.set_attribute("tandem.recomputed_tokens", decode_done.recomputed_tokens)
    return Finished(
        seq=decode_done.seq, finish_reason=decode_done.finish_reason,
        prompt_tokens=len(params.prompt_ids), cached_tokens=prefill_done.cached_tokens,
        completion_tokens=first_tokens + decode_done.completion_tokens,
        pulled_tokens=decode_done.pulled_tokens, recomputed_tokens=decode_done.recomputed_tokens)


class TwoPartStream:
    """Prefill part and decode part, read by `Generation` as one stream of tokens."""

    frames_ready = False  # each part's frames are read one at a time (the hand-off sits between them)

    def __init__(self, *, params: GenerationParams, link: WorkerLink, prefill: InFlight, decode: InFlight | None,
                 handoff: HandOff, metrics: RouterMetrics, span: trace.Span) -> None:
        # No decode part is needed when one token is all the client asked for.
        assert (decode is None) == (params.sampling.max_tokens == 1), "a decode part iff max_tokens > 1"
        assert decode is not None or not handoff.decode_first, "decode first needs a decode part"
        self._params = params
        self._link = link
        self._handoff = handoff
        self._metrics = metrics
        self._span = span
        self._prefill = WorkerPart(link, prefill, params.request_id)
        self._prefill_span = child_span("router.prefill", span, prefill.worker_id)
        self._decode_in_flight = decode
        self._decode: WorkerPart | None = None
        self._decode_span: trace.Span | None = None
        self._lease: KvHandle | None = None  # held for us by the prefill worker: ours to release
        self._first_token_ids: list[int] = []
        self._finished: Finished | None = None
        self._failed_worker_id: str | None = None
        self._prefill_sent = False
        self._decode_cancelled = False
        self._closed = False
        if handoff.decode_first:
            self._add_decode_part()

    @property
    def worker_id(self) -> str:
        if self._decode is not None and self._prefill.finished is not None:
            return self._decode.worker_id
        return self._prefill.worker_id

    @property
    def finished(self) -> Finished | None:
        return self._finished

    @property
    def failed_worker_id(self) -> str | None:
        return self._failed_worker_id

    async def open(self) -> None:
        """Send the part that goes first; raises `Unavailable` if it could not be sent."""
        if self._handoff.decode_first:
            await self._send_decode()
        else:
            await self._send_prefill(None)

    async def frames(self) -> AsyncIterator[Tokens]:
        # No cleanup here (the generator may be abandoned at any yield): `close()` does it all.
        target = await self._decode_target() if self._handoff.decode_first else None
        try:
            if not self._prefill_sent:
                await self._send_prefill(target)
            async for frame in self._prefill.frames():
                self._take_first_token(frame)
                yield frame
        except TandemError as error:
            self._fail(self._prefill.worker_id, self._prefill_span, error)
            await self._cancel_decode()  # no KV is coming: do not leave a waiting decode worker waiting
            raise
        prefill_done = self._prefill.finished
        assert prefill_done is not None
        self._lease = prefill_done.kv_handle
        end_span(self._prefill_span, OUTCOME_OK)
        await self._prefill.close()  # its in-flight slot is free from now on
        if not self._continues(prefill_done):
            await self._cancel_decode()  # decode first: the push it waits for carries no token
            if self._decode is None and self._decode_in_flight is not None:
                self._decode_in_flight.end()
            self._finished = msgspec.structs.replace(prefill_done, kv_handle=None)
            return  # `close()` releases the lease, if the prefill worker granted one
        try:
            if self._decode is None:
                await self._start_decode()
            assert self._decode is not None
            async for frame in self._decode.frames():
                yield frame
        except TandemError as error:
            assert self._decode_in_flight is not None
            self._fail(self._decode_in_flight.worker_id, self._decode_span, error)
            raise
        decode_done = self._decode.finished
        assert decode_done is not None and self._decode_span is not None
        self._lease = None  # the decode worker pulled the blocks and released the lease
        self._finished = merged_finished(self._params, prefill_done, len(self._first_token_ids), decode_done,
                                         (self._decode_span, self._span))
        end_span(self._decode_span, OUTCOME_OK)

    def _take_first_token(self, frame: Tokens) -> None:
        """A prefill part streams exactly one token; more is the prefill worker's error."""
        self._first_token_ids.extend(frame.token_ids)
        if len(self._first_token_ids) > 1:
            raise TandemError(f"prefill worker {self._prefill.worker_id} sent "
                              f"{len(self._first_token_ids)} tokens for a one-token prefill")

    def _continues(self, prefill_done: Finished) -> bool:
        """Whether the decode part has anything left to do after the prefill's `Finished` (not
        when the prefill ended without its one token, or when one token was all the client
        asked for; the hand-off decides about a stop token)."""
        return (self._decode_in_flight is not None and len(self._first_token_ids) == 1
                and self._handoff.continues_after(prefill_done))

    def _add_decode_part(self) -> None:
        in_flight = self._decode_in_flight
        assert in_flight is not None
        self._decode_span = child_span("router.decode", self._span, in_flight.worker_id)
        self._decode = WorkerPart(self._link, in_flight, self._params.request_id)

    async def _send_prefill(self, target: PushTarget | None) -> None:
        params = self._params
        request = GenerateRequest(request_id=params.request_id, model=params.model, token_ids=params.prompt_ids,
                                  sampling=params.sampling.first_token_only(), adapter=params.adapter,
                                  cache_salt=params.cache_salt,
                                  kv_transfer=self._handoff.prefill_transfer(target),
                                  images=list(params.images))
        self._prefill_sent = True  # from here on the prefill worker may be working on it
        await self._prefill.send(request, span_headers(self._prefill_span))

    async def _send_decode(self) -> None:
        assert self._decode is not None and self._decode_span is not None
        request = self._handoff.decode_request(self._params, self._first_token_ids, self._lease)
        await self._decode.send(request, span_headers(self._decode_span))

    async def _decode_target(self) -> PushTarget:
        """Decode first: the blocks its worker allocated for the prompt's KV."""
        assert self._decode is not None and self._decode_span is not None
        try:
            target = await self._decode.kv_target()  # bounded by the request plane's accept/idle timeouts
        except TandemError as error:
            self._fail(self._decode.worker_id, self._decode_span, error)
            raise
        self._decode_span.set_attribute("tandem.kv.push_blocks", len(target.block_ids))
        return target

    async def _start_decode(self) -> None:
        """Prefill first: the decode part starts now, on the lease the prefill worker granted."""
        in_flight = self._decode_in_flight
        assert in_flight is not None
        if in_flight.lost is not None:  # the decode worker left while the prompt was computed
            raise in_flight.lost
        self._add_decode_part()
        assert self._decode_span is not None
        self._decode_span.set_attribute("tandem.kv_source_tokens", 0 if self._lease is None else
                                        self._lease.num_tokens)
        await self._send_decode()

    def _fail(self, worker_id: str, span: trace.Span | None, error: TandemError) -> None:
        self._failed_worker_id = worker_id
        end_span(span, error.code.value)

    async def _cancel_decode(self) -> None:
        if self._decode is not None and not self._decode_cancelled and self._decode.finished is None:
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
                if self._decode is not None:
                    await self._decode.close()
                await self._release_lease()
            finally:
                if self._decode_in_flight is not None:
                    self._decode_in_flight.end()  # a no-op once its part ended it
                end_span(self._prefill_span, ErrorCode.CANCELLED.value)  # no-ops for parts that ended
                end_span(self._decode_span, ErrorCode.CANCELLED.value)

    async def _release_lease(self) -> None:
        if self._lease is None:
            return
        lease, self._lease = self._lease, None
        result = await self._link.release_lease(lease, span_headers(self._span))
        self._metrics.lease_releases.labels(result).inc()
        log.debug("%s: released lease %s on %s (%s)", self._params.request_id, lease.lease_id,
                  lease.holder_worker_id, result)
