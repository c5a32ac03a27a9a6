"""The prefill-first disaggregated flow (XpYd), pull mode: a `TokenSource` made of two
worker parts. (Push mode, decode worker first: `services.router.disaggregated_push`.)

1. The prefill worker gets the prompt with `max_tokens=1` and `hold_for_decode`: it
   computes the prompt, streams the first token, and ends with `Finished(kv_handle=...)`,
   a lease on the prompt's full blocks held for the decode worker (None when the prompt
   has no full block). The first token is yielded the moment it arrives: the client sees
   it before the decode worker is even asked.
2. Unless the request is over (the first token was a stop token, `max_tokens` was 1, or
   the prefill worker ended it otherwise), the decode worker gets `prompt + [first]`,
   `max_tokens - 1` and the handle as its `source`; it pulls the blocks, releases the
   lease itself, computes only what is missing, and streams the rest.

Lease ownership: from the prefill's `Finished` until the decode request ends in
`Finished`, the lease is this router's to release. Whenever the request ends otherwise
(client gone, decode refused, failed, or removed, or no decode needed), `close()` sends
`LeaseRelease(cancelled)` to the holder at once rather than leaving the blocks pinned
until the TTL. A decode worker that also released it makes that a harmless no-op.

Each part has its own in-flight slot (ended as soon as that part ends) and its own child
span of the router span, whose context travels to that worker in the NATS headers.
Failures of either part surface as the part's `TandemError`, and `failed_worker_id` names
the worker at fault: `Generation` resumes the request elsewhere when that worker was lost,
or turns the error into an HTTP error (before the first byte) or an SSE error event
(after), never a truncated 200.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import msgspec
from opentelemetry import trace

from services.router.kv_view import PrefixSource
from services.router.metrics import RouterMetrics
from services.router.records import OUTCOME_OK, GenerationParams
from services.router.token_source import WorkerPart
from services.router.worker_link import WorkerLink
from services.router.worker_pool import InFlight
from shared.errors import ErrorCode, TandemError
from shared.schemas import Finished, GenerateRequest, Tokens
from shared.schemas.transfer import KvHandle, KvTransferParams
from shared.tracing import inject_headers

log = logging.getLogger(__name__)
tracer = trace.get_tracer("tandem.router")


def child_span(name: str, parent: trace.Span, worker_id: str) -> trace.Span:
    return tracer.start_span(name, context=trace.set_span_in_context(parent),
                             attributes={"tandem.worker_id": worker_id})


def span_headers(span: trace.Span) -> dict[str, str]:
    with trace.use_span(span, end_on_exit=False):
        return inject_headers()


def end_span(span: trace.Span | None, outcome: str) -> None:
    if span is not None and span.is_recording():  # not yet ended
        span.set_attribute("tandem.outcome", outcome)
        span.end()


def merged_finished(params: GenerationParams, prefill_done: Finished, first_tokens: int, decode_done: Finished,
                    spans: tuple[trace.Span, ...]) -> Finished:
    """The request's `Finished` from its two parts' (the KV hand-off figures are the decode
    worker's), recording those figures on `spans`."""
    for span in spans:
        span.set_attribute("tandem.pulled_tokens", decode_done.pulled_tokens)
        span.set_attribute("tandem.recomputed_tokens", decode_done.recomputed_tokens)
    return Finished(
        seq=decode_done.seq, finish_reason=decode_done.finish_reason,
        prompt_tokens=len(params.prompt_ids), cached_tokens=prefill_done.cached_tokens,
        completion_tokens=first_tokens + decode_done.completion_tokens,
        pulled_tokens=decode_done.pulled_tokens, recomputed_tokens=decode_done.recomputed_tokens)


class TwoPartStream:
    """What both disaggregated flows keep: the prefill's first token, the request's merged
    `Finished`, and the worker at fault when a part failed."""

    def __init__(self, params: GenerationParams, span: trace.Span, prefill: WorkerPart) -> None:
        self._params = params
        self._span = span
        self._prefill = prefill
        self._prefill_span = child_span("router.prefill", span, prefill.worker_id)
        self._first_token_ids: list[int] = []
        self._finished: Finished | None = None
        self._failed_worker_id: str | None = None
        self._closed = False

    @property
    def finished(self) -> Finished | None:
        return self._finished

    @property
    def failed_worker_id(self) -> str | None:
        return self._failed_worker_id

    def _take_first_token(self, frame: Tokens) -> None:
        """A prefill part streams exactly one token; more is the prefill worker's error."""
        self._first_token_ids.extend(frame.token_ids)
        if len(self._first_token_ids) > 1:
            raise TandemError(f"prefill worker {self._prefill.worker_id} sent "
                              f"{len(self._first_token_ids)} tokens for a one-token prefill")


class DisaggregatedStream(TwoPartStream):
    """Prefill part, then decode part, read by `Generation` as one stream of tokens."""

    def __init__(self, *, params: GenerationParams, link: WorkerLink, prefill: InFlight, decode: InFlight | None,
                 metrics: RouterMetrics, span: trace.Span, prefix: PrefixSource | None = None) -> None:
        # No decode part is needed when one token is all the client asked for.
        assert (decode is None) == (params.sampling.max_tokens == 1), "a decode part iff max_tokens > 1"
        super().__init__(params, span, WorkerPart(link, prefill, params.request_id))
        self._prefix = prefix  # a worker holding more of the prompt than the prefill worker
        self._link = link
        self._metrics = metrics
        self._decode_in_flight = decode
        self._decode: WorkerPart | None = None
        self._decode_span: trace.Span | None = None
        self._lease: KvHandle | None = None  # held for us by the prefill worker: ours to release

    @property
    def worker_id(self) -> str:
        return self._decode.worker_id if self._decode is not None else self._prefill.worker_id

    async def open(self) -> None:
        """Send the prefill request; raises `Unavailable` if it could not be sent."""
        params = self._params
        hold = self._decode_in_flight is not None
        if self._prefix is not None:
            transfer = self._prefix.as_params(hold_for_decode=hold)
        else:
            transfer = KvTransferParams(hold_for_decode=True) if hold else None
        request = GenerateRequest(request_id=params.request_id, model=params.model, token_ids=params.prompt_ids,
                                  sampling=msgspec.structs.replace(params.sampling, max_tokens=1),
                                  kv_transfer=transfer)
        await self._prefill.send(request, span_headers(self._prefill_span))

    async def frames(self) -> AsyncIterator[Tokens]:
        # No cleanup here (the generator may be abandoned at any yield): `close()` does it all.
        try:
            async for frame in self._prefill.frames():
                self._take_first_token(frame)
                yield frame
        except TandemError as error:
            self._failed_worker_id = self._prefill.worker_id
            end_span(self._prefill_span, error.code.value)
            raise
        prefill_done = self._prefill.finished
        assert prefill_done is not None
        self._lease = prefill_done.kv_handle
        end_span(self._prefill_span, OUTCOME_OK)
        await self._prefill.close()  # its in-flight slot is free from now on
        if not self._continues(prefill_done):
            if self._decode_in_flight is not None:
                self._decode_in_flight.end()
            self._finished = msgspec.structs.replace(prefill_done, kv_handle=None)
            return  # `close()` releases the lease, if the prefill worker granted one
        try:
            decode = await self._open_decode()
            async for frame in decode.frames():
                yield frame
        except TandemError as error:
            assert self._decode_in_flight is not None
            self._failed_worker_id = self._decode_in_flight.worker_id
            end_span(self._decode_span, error.code.value)
            raise
        decode_done = decode.finished
        assert decode_done is not None
        self._lease = None  # the decode worker pulled the blocks and released the lease
        assert self._decode_span is not None
        self._finished = merged_finished(self._params, prefill_done, len(self._first_token_ids), decode_done,
                                         (self._decode_span, self._span))
        end_span(self._decode_span, OUTCOME_OK)

    def _continues(self, prefill_done: Finished) -> bool:
        """Whether a decode worker has anything left to do after the prefill's `Finished`
        (not after a stop token, an abort, or when one token was all the client asked for)."""
        return (self._decode_in_flight is not None and prefill_done.finish_reason == "length"
                and len(self._first_token_ids) == 1)

    async def _open_decode(self) -> WorkerPart:
        in_flight = self._decode_in_flight
        assert in_flight is not None
        if in_flight.lost is not None:  # the decode worker left while the prompt was computed
            raise in_flight.lost
        params = self._params
        self._decode_span = child_span("router.decode", self._span, in_flight.worker_id)
        self._decode = WorkerPart(self._link, in_flight, params.request_id)
        sampling = msgspec.structs.replace(params.sampling, max_tokens=params.sampling.max_tokens - 1)
        # Without a handle (no full block in the prompt) the decode worker computes everything.
        transfer = KvTransferParams(source=self._lease) if self._lease is not None else None
        request = GenerateRequest(request_id=params.request_id, model=params.model,
                                  token_ids=[*params.prompt_ids, *self._first_token_ids], sampling=sampling,
                                  kv_transfer=transfer)
        self._decode_span.set_attribute("tandem.kv_source_tokens", 0 if self._lease is None else
                                        self._lease.num_tokens)
        await self._decode.send(request, span_headers(self._decode_span))
        return self._decode

    async def cancel(self) -> None:
        if self._prefill.finished is None:
            await self._prefill.cancel()
        if self._decode is not None and self._decode.finished is None:
            await self._decode.cancel()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._prefill.close()
            if self._decode is not None:
                await self._decode.close()
            if self._lease is not None:
                lease, self._lease = self._lease, None
                result = await self._link.release_lease(lease)
                self._metrics.lease_releases.labels(result).inc()
                log.debug("%s: released lease %s on %s (%s)", self._params.request_id, lease.lease_id,
                          lease.holder_worker_id, result)
        finally:
            if self._decode_in_flight is not None:
                self._decode_in_flight.end()
            end_span(self._prefill_span, ErrorCode.CANCELLED.value)  # no-ops for parts that ended
            end_span(self._decode_span, ErrorCode.CANCELLED.value)
