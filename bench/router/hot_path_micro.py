"""CPU of two pieces of the router's hot path, in-process (`time.thread_time`), on whichever
tree it runs from (`cd <tree> && PYTHONPATH=. python bench/router/hot_path_micro.py [runs]`):
how the savings in bench/results/router-profile.md ("Three costs, one at a time") were
measured.

- `frames`: one generate stream's frames, each arriving while its reader waits
  (`ResponseStream._receive` then `frames()`), per frame.
- `metrics`: the router's metric calls for one request of 8 tokens (requests, route decision,
  queue, TTFT, 7 token gaps, end to end), per request, with a trace id as exemplar. The
  metrics API took a span (before) and takes an exemplar (after): both are handled.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

import uvloop
from nats.aio.msg import Msg
from opentelemetry import trace

from services.router.metrics import RouterMetrics
from shared.codec import MalformedCounter, encode
from shared.request_plane import ResponseStream
from shared.schemas import Accepted, Finished, Tokens
from shared.tracing import setup_tracing

TOKENS = 8
STREAMS = 2000
REQUESTS = 20000


async def _frames_cpu() -> float:
    """CPU-µs per frame: Accepted, TOKENS token frames, Finished, each put while the reader waits."""
    frames = [encode(Accepted(seq=0, worker_id="w1"))]
    frames += [encode(Tokens(seq=seq, token_ids=[seq])) for seq in range(1, TOKENS + 1)]
    frames.append(encode(Finished(seq=TOKENS + 1, finish_reason="length", prompt_tokens=10, cached_tokens=0,
                                  completion_tokens=TOKENS)))
    messages = [Msg(_client=None, subject="inbox", data=data) for data in frames]  # type: ignore[arg-type]

    async def feed(stream: ResponseStream) -> None:
        for msg in messages:
            await asyncio.sleep(0)  # the reader waits before each frame arrives
            await stream._receive(msg)

    async def read(stream: ResponseStream) -> None:
        async for _ in stream.frames():
            pass

    started = time.thread_time()
    for _ in range(STREAMS):
        stream = ResponseStream(None, "generate.w1", accept_timeout_s=30.0, idle_timeout_s=30.0)  # type: ignore[arg-type]
        await asyncio.gather(feed(stream), read(stream))
    return (time.thread_time() - started) / STREAMS / len(messages) * 1e6


def _metrics_cpu() -> float:
    """CPU-µs per request of the router's metric calls."""
    metrics = RouterMetrics(MalformedCounter())
    span = trace.get_tracer("bench").start_span("request")
    with_exemplar = hasattr(metrics, "count_request")
    started = time.thread_time()
    for _ in range(REQUESTS):
        if with_exemplar:
            from shared.prometheus import trace_exemplar

            exemplar = trace_exemplar(span)  # once per request (Generation)
            metrics.count_route("single", "kv")
            metrics.observe_queue("w1", 0.001, trace_exemplar(span))
            metrics.observe_ttft("w1", 0.01, exemplar)
            for _ in range(TOKENS - 1):
                metrics.record_tokens_between(0.003, 1, "w1", exemplar)
            metrics.count_request("completions", "ok")
            metrics.observe_e2e(0.05, trace_exemplar(span))
        else:
            metrics.route_decisions.labels("single", "kv").inc()
            metrics.observe_queue("w1", 0.001, span)
            metrics.observe_ttft("w1", 0.01, span)
            for _ in range(TOKENS - 1):
                metrics.record_tokens_between(0.003, 1, "w1", span)
            metrics.requests.labels("completions", "ok").inc()
            metrics.observe_e2e(0.05, span)
    return (time.thread_time() - started) / REQUESTS * 1e6


def main() -> None:
    setup_tracing("bench")
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        frames = [runner.run(_frames_cpu()) for _ in range(repeats)]
    metrics = [_metrics_cpu() for _ in range(repeats)]
    print(f"frames: {statistics.median(frames):.2f} CPU-us per frame (runs: {', '.join(f'{v:.2f}' for v in frames)})")
    print(f"metrics: {statistics.median(metrics):.2f} CPU-us per request (runs: {', '.join(f'{v:.2f}' for v in metrics)})")


if __name__ == "__main__":
    main()
