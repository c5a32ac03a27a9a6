"""Runs one generate request on the engine: the request's part of a KV hand-off first
(pull, push or hold), then the engine's outputs streamed as frames, ending in exactly one
`Finished` or `Failed`. Called by `WorkerService` once per request, in its own task.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import msgspec
from opentelemetry import trace

from connector.dataplane import DataPlane, Prepared
from connector.push import PushWriter
from services.worker.engine import Engine, EngineOutput
from shared.block_hash import block_hash_chain
from shared.errors import ErrorCode, TandemError
from shared.request_plane import FrameSender
from shared.schemas import GenerateRequest, PushDone, SamplingParams
from shared.tracing import extract_context

log = logging.getLogger(__name__)
tracer = trace.get_tracer("tandem.worker")


@dataclass(slots=True)
class KvPlan:
    """How a request runs after its KV hand-off is prepared."""

    token_ids: list[int] = field(default_factory=list)
    sampling: SamplingParams = SamplingParams()
    prepared: Prepared = field(default_factory=Prepared)
    hold: bool = False  # lease the prompt's blocks for a decode worker when prefill ends
    writer: PushWriter | None = None  # push the prompt's KV to a decode worker as it is computed
    finish_before_start: bool = False  # the pushed first token is a stop token


class RequestRunner:
    def __init__(self, worker_id: str, engine: Engine, kv: DataPlane | None) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.kv = kv

    async def run(self, request: GenerateRequest, sender: FrameSender, headers: dict[str, str]) -> None:
        with tracer.start_as_current_span("worker.generate", context=extract_context(headers)) as span:
            span.set_attribute("tandem.worker_id", self.worker_id)
            span.set_attribute("tandem.request_id", request.request_id)
            span.set_attribute("tandem.prompt_tokens", len(request.token_ids))
            outputs = None
            plan = KvPlan()
            handle = None
            try:
                await sender.accepted(self.worker_id)
                if request.model != self.engine.info.model:
                    raise TandemError(f"worker {self.worker_id} serves {self.engine.info.model!r}, "
                                      f"not {request.model!r}", code=ErrorCode.NOT_FOUND)
                plan = await self._prepare_kv(request, sender)
                span.set_attribute("tandem.kv.pulled_tokens", plan.prepared.pulled_tokens)
                if plan.finish_before_start:
                    await sender.finished("stop", prompt_tokens=len(plan.token_ids), cached_tokens=0,
                                          completion_tokens=0, pulled_tokens=plan.prepared.pulled_tokens)
                    return
                outputs = self.engine.generate(request.request_id, plan.token_ids, plan.sampling,
                                               **({"on_layer": plan.writer.on_layer} if plan.writer else {}))
                if self.kv is not None:
                    # The pulled blocks are in the prefix cache now. Holding them pinned until
                    # admission could deadlock a full pool (queued requests each pinning blocks
                    # the others need); unpinned, the worst case is an eviction and a recompute.
                    self.kv.release_pins(plan.prepared)
                replay = ReplayedTokens(len(plan.sampling.replayed))
                async for output in outputs:
                    output = replay.left_out(output)
                    handle = None
                    if output.finished and plan.hold:
                        handle = self.kv.hold(request)  # before any await: the blocks could be evicted
                    if output.finished and plan.writer is not None:
                        plan.writer.send_reused(block_hash_chain(request.token_ids, self.engine.info.block_size),
                                                self.engine.info.layout.num_layers)  # before any await, too
                        done = await plan.writer.finish(output.token_ids[0] if output.token_ids else None)
                        span.set_attribute("tandem.kv.push_writes", len(plan.writer.timings))
                        self.kv.last_push_timings = plan.writer.timings
                        await self.kv.send_push_done(plan.writer.target, done)
                        plan.writer = None
                    if output.token_ids:
                        await sender.tokens(output.token_ids, output.logprobs, output.prompt_logprobs)
                    if output.finished:
                        span.set_attribute("tandem.cached_tokens", output.cached_tokens)
                        await sender.finished(output.finish_reason, prompt_tokens=output.prompt_tokens,
                                              cached_tokens=output.cached_tokens,
                                              completion_tokens=output.completion_tokens, kv_handle=handle,
                                              pulled_tokens=plan.prepared.pulled_tokens,
                                              recomputed_tokens=plan.prepared.recomputed_tokens)
                        return
                raise TandemError("engine ended the request without a finish reason")
            except asyncio.CancelledError:
                if handle is not None and not sender.closed:  # the caller never saw the handle
                    self.kv.release_hold(handle)
                if not sender.closed:
                    await _quietly(sender.failed(ErrorCode.CANCELLED.value, "request cancelled"))
                raise
            except TandemError as error:
                span.set_attribute("tandem.error", error.code.value)
                await _quietly(sender.failed(error.code.value, error.message))
            except Exception as error:
                log.exception("request %s failed", request.request_id)
                await _quietly(sender.failed(ErrorCode.INTERNAL.value, f"internal error: {error}"))
            finally:
                if outputs is not None:
                    await outputs.aclose()  # aborts the engine request if it is still running
                if self.kv is not None:
                    self.kv.release_pins(plan.prepared)
                if plan.writer is not None:  # the push did not complete: the reader must not wait
                    plan.writer.abort()
                    await _quietly(self.kv.send_push_done(plan.writer.target, PushDone(
                        transfer_id=plan.writer.target.transfer_id, outcome="failed", checksums=[])))

    async def _prepare_kv(self, request: GenerateRequest, sender: FrameSender) -> KvPlan:
        """Do the request's part of a KV hand-off before it runs (see KvTransferParams)."""
        params = request.kv_transfer
        plan = KvPlan(token_ids=request.token_ids, sampling=request.sampling)
        if params is None:
            return plan
        if self.kv is None:
            if params.source is None and params.push_to is None and not params.await_push and not params.hold_for_decode:
                return plan  # only a prefix-pull hint: computing the prefix here is the same answer
            raise TandemError(f"worker {self.worker_id} has no KV data plane", code=ErrorCode.UNAVAILABLE)
        plan.hold = params.hold_for_decode
        if params.await_push:
            receiver = await self.kv.push_receiver(request)
            await sender.kv_target(receiver.target)
            first_token, plan.prepared = await self.kv.await_push(request, receiver)
            plan.token_ids = [*request.token_ids, first_token]
            plan.finish_before_start = first_token in request.sampling.stop_token_ids
        elif params.push_to is not None:
            plan.writer = self.kv.push_writer(request, params.push_to)
            if not await self.kv.ensure_push_peer(params.push_to):
                raise TandemError(f"decode worker {params.push_to.reader_worker_id} is unreachable",
                                  code=ErrorCode.UNAVAILABLE)
        else:
            plan.prepared = await self.kv.prepare(request)
        return plan


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
