"""One generate request: token frames in, text pieces out, one outcome.

`Generation` is opened by the `Dispatcher` on a `TokenSource`: one worker (single-worker
flow) or a prefill worker then a decode worker (disaggregated flow). `prime()` waits for
the first output, so the dispatcher can still re-route a request a worker refused.
`next()` turns token frames into text (incremental detokenization, then stop strings)
and ends with one `Final`. `close()` always runs, exactly once: it cancels the remaining
work unless the worker ended the request itself (client gone, stop string, router-side
failure), closes the source (in-flight slots, leases), ends the span and records the
outcome.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace

from services.router.detokenizer import IncrementalDetokenizer, TokenDecoder
from services.router.metrics import RouterMetrics
from services.router.records import OUTCOME_OK, Clock, GenerationParams, RequestRecorder, TokenUsage
from services.router.stop_strings import StopStringMatcher
from services.router.token_source import TokenSource
from shared.errors import ErrorCode, TandemError
from shared.schemas import Tokens


@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class Final:
    text: str  # the last piece of text (may be empty)
    finish_reason: str
    usage: TokenUsage


class Generation:
    def __init__(self, *, params: GenerationParams, source: TokenSource, decoder: TokenDecoder,
                 metrics: RouterMetrics, recorder: RequestRecorder, clock: Clock, span: trace.Span) -> None:
        self.params = params
        self._source = source
        self._frames = source.frames()
        self._detokenizer = IncrementalDetokenizer(decoder, params.prompt_ids)
        self._stops = StopStringMatcher(params.stop)
        self._metrics = metrics
        self._recorder = recorder
        self._clock = clock
        self._span = span
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._completion_tokens = 0
        self._primed: Tokens | None = None  # the first frame, pulled by prime()
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
        """The next non-empty piece of text, or the `Final` one; raises `TandemError`."""
        assert self._final is None, "next() called after the final piece"
        while True:
            if self._primed is not None:
                frame, self._primed = self._primed, None
            else:
                frame = await self._next_frame()
            if frame is None:
                return self._finish_from_worker()
            text = self._stops.push(self._detokenizer.push(frame.token_ids))
            if self._stops.stopped:
                await self._source.cancel()
                return self._finish(text, "stop", TokenUsage(len(self.params.prompt_ids), self._completion_tokens,
                                                             cached_tokens=0))
            if text:
                return Delta(text)

    async def _next_frame(self) -> Tokens | None:
        """The next token frame; None once the worker sent `Finished`."""
        try:
            frame = await anext(self._frames)
        except StopAsyncIteration:
            return None
        except TandemError as error:
            self._outcome = error.code.value
            raise
        self._on_tokens(len(frame.token_ids))
        return frame

    def _on_tokens(self, count: int) -> None:
        now = self._clock()
        if self._first_token_at is None:
            self._first_token_at = now
            self._metrics.ttft.observe(now - self.params.arrived_at)
        elif self._last_token_at is not None:
            self._metrics.record_tokens_between(now - self._last_token_at, count)
        self._last_token_at = now
        self._completion_tokens += count

    def _finish_from_worker(self) -> Final:
        finished = self._source.finished
        assert finished is not None
        self._metrics.kv_pulled_tokens.inc(finished.pulled_tokens)
        self._metrics.kv_recomputed_tokens.inc(finished.recomputed_tokens)
        usage = TokenUsage(finished.prompt_tokens, finished.completion_tokens, finished.cached_tokens)
        text = self._stops.push(self._detokenizer.flush())
        if self._stops.stopped:
            return self._finish(text, "stop", usage)
        return self._finish(text + self._stops.flush(), finished.finish_reason, usage)

    def _finish(self, text: str, finish_reason: str, usage: TokenUsage) -> Final:
        self._outcome = OUTCOME_OK
        self._final = Final(text, finish_reason, usage)
        return self._final

    async def close(self, *, record: bool = True) -> None:
        """Release everything; `record=False` when the request is re-routed elsewhere."""
        if self._closed:
            return
        self._closed = True
        outcome = self._outcome or ErrorCode.CANCELLED.value  # nothing else ended it: the client left
        try:
            if self._source.finished is None and not self._stops.stopped:
                await self._source.cancel()  # a no-op on the worker if it already ended the request
            try:
                await self._frames.aclose()
            except RuntimeError:  # still running in a task being cancelled: it ends with that task
                pass
        finally:
            try:
                await self._source.close()
            finally:
                self._span.set_attribute("tandem.outcome", outcome)
                self._span.end()
                if record:
                    final = self._final
                    usage = final.usage if final else TokenUsage(len(self.params.prompt_ids),
                                                                 self._completion_tokens, 0)
                    await self._recorder.record(self.params, outcome=outcome, worker_id=self.worker_id,
                                                finish_reason=final.finish_reason if final else None,
                                                usage=usage, ttft_s=self.ttft_s)
