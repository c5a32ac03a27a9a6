"""Runs one generate request on the engine, inside its KV session (`connector.kv_session`:
pull, push or hold, and their cleanup on every exit), the engine's outputs streamed as
frames, ending in exactly one `Finished` or `Failed`. Called by `request_plane.RequestPlane` once per
request, in its own task. A request naming a LoRA adapter takes one of the worker's adapter
slots first (`adapter_slots`); `on_adapters_changed` announces a newly loaded one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import aclosing

import msgspec
from opentelemetry import trace

from connector.dataplane import DataPlane
from connector.kv_session import KvSession
from services.worker.adapter_slots import AdapterSlots
from services.worker.engine import Engine, EngineOutput
from shared.errors import ErrorCode, TandemError
from shared.frame_sender import FrameSender
from shared.schemas import GenerateRequest
from shared.tracing import extract_context

log = logging.getLogger(__name__)
tracer = trace.get_tracer("tandem.worker")


class RequestRunner:
    def __init__(self, worker_id: str, engine: Engine, kv: DataPlane | None, adapters: AdapterSlots | None = None,
                 on_adapters_changed: Callable[[], None] = lambda: None) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.kv = kv
        self.adapters = adapters if adapters is not None else AdapterSlots(0)
        self._on_adapters_changed = on_adapters_changed

    async def run(self, request: GenerateRequest, sender: FrameSender, headers: dict[str, str]) -> None:
        with tracer.start_as_current_span("worker.generate", context=extract_context(headers)) as span:
            span.set_attributes({"tandem.worker_id": self.worker_id, "tandem.request_id": request.request_id,
                                 "tandem.prompt_tokens": len(request.token_ids)})
            try:
                await sender.accepted(self.worker_id)
                if request.model != self.engine.info.model:
                    raise TandemError(f"worker {self.worker_id} serves {self.engine.info.model!r}, "
                                      f"not {request.model!r}", code=ErrorCode.NOT_FOUND)
                if request.adapter:
                    self._take_adapter(request.adapter)
                info = self.engine.info
                async with KvSession(self.kv, self.worker_id, request, sender, block_size=info.block_size,
                                     num_layers=info.layout.num_layers) as kv:
                    span.set_attribute("tandem.kv.pulled_tokens", kv.prepared.pulled_tokens)
                    if kv.finish_before_start:
                        await sender.finished("stop", prompt_tokens=len(kv.token_ids), cached_tokens=0,
                                              completion_tokens=0, pulled_tokens=kv.prepared.pulled_tokens)
                        return
                    await self._stream(request, kv, sender, span)
            except asyncio.CancelledError:
                if not sender.closed:
                    await _quietly(sender.failed(ErrorCode.CANCELLED.value, "request cancelled"))
                raise
            except TandemError as error:
                span.set_attribute("tandem.error", error.code.value)
                await _quietly(sender.failed(error.code.value, error.message))
            except Exception as error:
                log.exception("request %s failed", request.request_id)
                await _quietly(sender.failed(ErrorCode.INTERNAL.value, f"internal error: {error}"))

    def _take_adapter(self, adapter: str) -> None:
        use = self.adapters.use(adapter)
        if use is None:
            raise TandemError(f"worker {self.worker_id} serves no LoRA adapters (asked for {adapter!r})",
                              code=ErrorCode.INVALID_ARGUMENT)
        if not use.held:
            log.info("worker %s loads adapter %s%s", self.worker_id, adapter,
                     f" in place of {use.evicted}" if use.evicted else "")
            self._on_adapters_changed()

    async def _stream(self, request: GenerateRequest, kv: KvSession, sender: FrameSender, span: trace.Span) -> None:
        """The engine's outputs as frames, ending in `Finished`; closing the outputs aborts the
        engine's request if it is still running."""
        outputs = self.engine.generate(request.request_id, kv.token_ids, kv.sampling, on_layer=kv.on_layer,
                                       adapter=request.adapter, cache_salt=request.cache_salt, images=request.images)
        async with aclosing(outputs):
            kv.admitted()
            replay = ReplayedTokens(len(kv.sampling.replayed))
            async for output in outputs:
                output = replay.left_out(output)
                handle = None
                if output.finished:
                    handle = await kv.at_final_output(output.token_ids[0] if output.token_ids else None)
                if output.token_ids:
                    await sender.tokens(output.token_ids, output.logprobs, output.prompt_logprobs)
                if output.finished:
                    span.set_attribute("tandem.cached_tokens", output.cached_tokens)
                    await sender.finished(output.finish_reason, prompt_tokens=output.prompt_tokens,
                                          cached_tokens=output.cached_tokens,
                                          completion_tokens=output.completion_tokens, kv_handle=handle,
                                          pulled_tokens=kv.prepared.pulled_tokens,
                                          recomputed_tokens=kv.prepared.recomputed_tokens)
                    return
        raise TandemError("engine ended the request without a finish reason")


async def _quietly(coro) -> None:
    """Send a last frame; if NATS is gone the caller's own timeout reports the failure."""
    try:
        await coro
    except Exception as error:
        log.debug("could not send final frame: %s", error)


class ReplayedTokens:
    """Leaves out of an engine's outputs the tokens it made again (`SamplingParams.replayed`):
    another engine already sent them."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._left = count

    def left_out(self, output: EngineOutput) -> EngineOutput:
        if not self.count:
            return output
        skip = min(self._left, len(output.token_ids))
        self._left -= skip
        return msgspec.structs.replace(
            output, token_ids=output.token_ids[skip:],
            logprobs=output.logprobs[skip:] if output.logprobs is not None else None,
            completion_tokens=max(0, output.completion_tokens - self.count) if output.finished
            else output.completion_tokens)
