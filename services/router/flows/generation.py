"""One generate request: token frames in, text pieces out, one outcome.

`Generation` is opened by the `Dispatcher` on a `TokenSource`, the flow executor's run of a
route plan: one worker (single-worker flow) or a prefill and a decode worker
(disaggregated flow). `prime()` waits for the first output, so a failure before it is
still a proper HTTP status. `next()` turns token frames into text (incremental
detokenization, then stop strings) and ends with one `Final`. `close()` always runs, exactly once: it cancels the remaining work unless the
worker ended the request itself (client gone, stop string, router-side failure), closes
the source (in-flight slots, leases), ends the span and records the outcome.

Losing a worker (`Disconnected`, `Unavailable`, `StreamGap`) is not the client's problem
while another worker can take over: the source is closed and the `Resumer` (the source
opener, `flows.opener.SourceOpener`) opens a new one
on another worker for the prompt plus every token generated so far, with `max_tokens`
reduced by them. Before the first token that is a plain retry; mid-stream the client's
stream simply continues, and a greedy request reads exactly as an uninterrupted one.
After the router's own NATS reconnect (`Reconnected`: frames may have been lost) the same
worker may take the continuation. At most `max_attempts` sources per request; when no
worker can take it, the original error reaches the client.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from opentelemetry import trace

from services.router.flows.detokenizer import IncrementalDetokenizer, SpecialTokensKept, TokenDecoder
from services.router.flows.records import OUTCOME_OK, Clock, GenerationParams, RequestRecorder, RouteNote, TokenUsage
from services.router.flows.stop_strings import StopStringMatcher
from services.router.flows.token_source import TokenSource
from services.router.metrics import RouterMetrics
from shared.errors import Disconnected, ErrorCode, Reconnected, StreamGap, TandemError, Unavailable
from shared.prometheus import trace_exemplar
from shared.schemas import TokenLogprobs, Tokens

log = logging.getLogger(__name__)

# The worker is gone or never took the request: another worker may carry on.
WORKER_LOST = (Disconnected, Unavailable, StreamGap)


@dataclass(frozen=True)
class Delta:
    text: str
    logprobs: tuple[TokenLogprobs, ...] = ()  # of the piece's tokens, when the request asked
    completion_tokens: int = 0  # generated up to the piece's end (a stream's usage so far)
    token_ids: tuple[int, ...] = ()  # the piece's generated tokens (those a held-back text came from too)


@dataclass(frozen=True)
class Final:
    text: str  # the last piece of text (may be empty)
    finish_reason: str
    usage: TokenUsage
    logprobs: tuple[TokenLogprobs, ...] = ()
    token_ids: tuple[int, ...] = ()  # the last piece's generated tokens: every piece's add up to usage's count


class Resumer(Protocol):
    async def resume(self, params: GenerationParams, route: RouteNote, generated: list[int], excluded: set[str],
                     attempt: int, span: trace.Span) -> TokenSource:
        """A source continuing `params` (routed as `route` says) after `generated` on a worker
        not in `excluded`; raises `TandemError` when no worker can take it."""
        ...


class Generation:
    def __init__(self, *, params: GenerationParams, source: TokenSource, decoder: TokenDecoder,
                 metrics: RouterMetrics, recorder: RequestRecorder, clock: Clock, span: trace.Span,
                 route: RouteNote | None = None, resumer: Resumer | None = None, max_attempts: int = 1,
                 on_close: Callable[[TokenUsage], None] | None = None) -> None:
        self.params = params
        self._route = route or RouteNote()  # its routing record (`records.RouteNote`), for its resumes and record
        self._on_close = on_close  # told what the request used once it ended (the admission gate)
        self._source = source
        self._frames = source.frames()
        self._resumer = resumer
        self._max_attempts = max_attempts
        self._attempts = 1  # sources opened for this request
        self._excluded: set[str] = set()  # workers lost by this request
        self._token_ids: list[int] = []  # every token generated so far, over all sources
        if not params.skip_special_tokens:
            decoder = SpecialTokensKept(decoder)
        self._detokenizer = IncrementalDetokenizer(decoder, params.prompt_ids)
        self._stops = StopStringMatcher(params.stop, include=params.include_stop_str)
        self._stop_token_ids = params.stop_token_ids
        self._metrics = metrics
        self._recorder = recorder
        self._clock = clock
        self._span = span
        self._exemplar = trace_exemplar(span)  # the request's trace id on its latency observations
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._completion_tokens = 0
        # the prompt's log-probabilities, once the first frame brought them (when the request asked)
        self.prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
        self._primed: Tokens | None = None  # the first frame, pulled by prime()
        self._deferred_error: TandemError | None = None  # raised by the next next(), after the text before it
        self._outcome: str | None = None  # set as soon as the request's fate is known
        self._final: Final | None = None
        self._closed = False

    @property
    def worker_id(self) -> str:
        return self._source.worker_id

    @property
    def ttft_s(self) -> float | None:
        return None if self._first_token_at is None else self._first_token_at - self.params.arrived_at

    async def prime(self) -> None:
        """Wait for the first output (or the end); raises `TandemError` if there is none."""
        self._primed = await self._next_frame()

    async def next(self) -> Delta | Final:
        """The next non-empty piece of text, or the `Final` one; raises `TandemError`.

        Frames that already arrived are taken into the same piece (one SSE chunk for what
        the worker sent while the client was being answered); each frame still meets the
        stop strings on its own, so a stop ends the request at the same token."""
        assert self._final is None, "next() called after the final piece"
        if self._deferred_error is not None:
            error, self._deferred_error = self._deferred_error, None
            raise error
        pieces: list[str] = []
        positions: list[TokenLogprobs] = []  # the log-probabilities of the pieces' tokens
        ids: list[int] = []  # the pieces' tokens
        while True:
            if self._primed is not None:
                frame, self._primed = self._primed, None
            else:
                try:
                    frame = await self._next_frame()
                except TandemError as error:
                    if not pieces:
                        raise
                    self._deferred_error = error  # the text before the failure reaches the client first
                    return Delta("".join(pieces), tuple(positions), self._completion_tokens, tuple(ids))
            if frame is None:
                final = self._finish_from_worker()
                final = self._final = Final("".join(pieces) + final.text, final.finish_reason, final.usage,
                                            tuple(positions), tuple(ids))
                return final
            text, unused = self._text_of(frame.token_ids)
            used = len(frame.token_ids) - unused
            if frame.logprobs:
                positions.extend(frame.logprobs[:used])
            ids.extend(frame.token_ids[:used])
            if self._stops.stopped:
                await self._source.cancel()
                pieces.append(text)
                self._final = Final("".join(pieces), "stop", TokenUsage(
                    len(self.params.prompt_ids), self._completion_tokens - unused, cached_tokens=0),
                    tuple(positions), tuple(ids))
                self._outcome = OUTCOME_OK
                return self._final
            if text:
                pieces.append(text)
            if pieces and not self._source.frames_ready:
                return Delta("".join(pieces), tuple(positions), self._completion_tokens, tuple(ids))

    async def _next_frame(self) -> Tokens | None:
        """The next token frame; None once the worker sent `Finished`."""
        while True:
            try:
                frame = await anext(self._frames)
            except StopAsyncIteration:
                return None
            except WORKER_LOST as error:
                if await self._resume(error):
                    continue
                self._outcome = error.code.value
                raise
            except TandemError as error:
                self._outcome = error.code.value
                raise
            self._token_ids.extend(frame.token_ids)
            self._on_tokens(len(frame.token_ids))
            if frame.prompt_logprobs is not None and self.prompt_logprobs is None:
                self.prompt_logprobs = tuple(frame.prompt_logprobs)
            return frame

    async def _resume(self, error: TandemError) -> bool:
        """Carry on from another worker after losing this one; False when none can."""
        lost = self._source.failed_worker_id or self._source.worker_id
        if not isinstance(error, Reconnected):  # the router's own reconnect: the worker may serve it again
            self._excluded.add(lost)
        stage = "mid_stream" if self._token_ids else "before_first_token"
        if self._resumer is None or self._attempts >= self._max_attempts:
            if self._resumer is not None:
                self._metrics.resumes.labels(stage, "failed").inc()
            return False
        log.info("%s lost worker %s %s (%s); resuming after %d tokens", self.params.request_id, lost,
                 stage.replace("_", " "), error.message, len(self._token_ids))
        await self._release_source(cancel=True)
        self._attempts += 1
        # why the next attempt exists: its `router.resume` span carries the same attempt number
        self._span.add_event("router.worker_lost", {"tandem.lost_worker_id": lost, "tandem.stage": stage,
                                                    "tandem.error": error.message, "tandem.attempt": self._attempts - 1})
        try:
            source = await self._resumer.resume(self.params, self._route, list(self._token_ids), self._excluded,
                                                self._attempts - 1, self._span)
        except TandemError as resume_error:
            self._metrics.resumes.labels(stage, "failed").inc()
            self._span.add_event("router.resume_failed", {"tandem.lost_worker_id": lost, "tandem.stage": stage,
                                                          "tandem.error": resume_error.message})
            log.info("%s cannot resume: %s", self.params.request_id, resume_error.message)
            return False
        self._metrics.resumes.labels(stage, "resumed").inc()
        self._source, self._frames = source, source.frames()
        return True

    async def _release_source(self, *, cancel: bool) -> None:
        """Stop the current source's work (if `cancel` and its worker still does any) and
        free its slots."""
        source = self._source
        try:
            if cancel and source.finished is None:
                await source.cancel()  # a no-op on the worker if it already ended the request
            try:
                await self._frames.aclose()
            except RuntimeError:  # still running in a task being cancelled: it ends with that task
                pass
        finally:
            await source.close()

    def _on_tokens(self, count: int) -> None:
        now = self._clock()
        if self._first_token_at is None:
            self._first_token_at = now
            self._metrics.observe_ttft(self._source.worker_id, now - self.params.arrived_at, self._exemplar)
        elif self._last_token_at is not None:
            self._metrics.record_tokens_between(now - self._last_token_at, count, self._source.worker_id,
                                                self._exemplar)
        self._last_token_at = now
        self._completion_tokens += count

    def _text_of(self, token_ids: list[int]) -> tuple[str, int]:
        """The text a frame adds, up to a stop string if one completes in it (never in the
        answer's first `min_tokens` tokens, as vLLM's server), and how many of its tokens came
        after the one that completed it (not counted, as vLLM counts)."""
        before = self._completion_tokens - len(token_ids)  # the answer's tokens before this frame
        min_tokens = self.params.sampling.min_tokens
        if not self.params.stop or (len(token_ids) == 1 and before + 1 > min_tokens):
            return self._stops.push(self._detokenizer.push(self._shown(token_ids))), 0
        pieces = []
        for index in range(len(token_ids)):
            text = self._detokenizer.push(self._shown(token_ids[index:index + 1]))
            pieces.append(self._stops.push(text, search=before + index + 1 > min_tokens))
            if self._stops.stopped:
                return "".join(pieces), len(token_ids) - index - 1
        return "".join(pieces), 0

    def _shown(self, token_ids: list[int]) -> list[int]:
        """The tokens whose text the answer shows: a stop token's text is left out, as vLLM's
        server leaves it unless asked to include it (a stop token always ends the request: it
        is the frame's last)."""
        if token_ids and token_ids[-1] in self._stop_token_ids and not self.params.include_stop_str:
            return token_ids[:-1]
        return token_ids

    def _finish_from_worker(self) -> Final:
        finished = self._source.finished
        assert finished is not None
        self._metrics.kv_pulled_tokens.inc(finished.pulled_tokens)
        self._metrics.kv_recomputed_tokens.inc(finished.recomputed_tokens)
        if self._attempts > 1:  # the last source saw a longer prompt and only its own tokens
            prompt_tokens = len(self.params.prompt_ids)
            usage = TokenUsage(prompt_tokens, self._completion_tokens, min(finished.cached_tokens, prompt_tokens))
        else:
            usage = TokenUsage(finished.prompt_tokens, finished.completion_tokens, finished.cached_tokens)
        text = self._stops.push(self._detokenizer.finish())
        if self._stops.stopped:
            return self._finish(text, "stop", usage)
        return self._finish(text + self._stops.flush(), finished.finish_reason, usage)

    def _finish(self, text: str, finish_reason: str, usage: TokenUsage) -> Final:
        self._outcome = OUTCOME_OK
        self._final = Final(text, finish_reason, usage)
        return self._final

    async def close(self) -> None:
        """Release everything and record the outcome."""
        if self._closed:
            return
        self._closed = True
        outcome = self._outcome or ErrorCode.CANCELLED.value  # nothing else ended it: the client left
        try:
            await self._release_source(cancel=not self._stops.stopped)  # a stop string cancelled it already
        finally:
            self._span.set_attribute("tandem.outcome", outcome)
            self._span.end()
            final = self._final
            usage = final.usage if final else TokenUsage(len(self.params.prompt_ids), self._completion_tokens, 0)
            if self._on_close is not None:
                self._on_close(usage)
            await self._recorder.record(self.params, outcome=outcome, worker_id=self.worker_id or None,
                                        finish_reason=final.finish_reason if final else None,
                                        usage=usage, ttft_s=self.ttft_s, span=self._span, route=self._route)
