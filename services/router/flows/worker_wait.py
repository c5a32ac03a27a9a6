"""Waiting for a worker that can take a request (adapter around `routing.cold_start`).

A request waits up to `worker_wait_s` (from its arrival) for a worker that can take it:
each change of membership, it is routed again. A scalable model's request
(`ScaleFromZeroConfig`) that no worker can take is held instead (`routing.cold_start`: a
bounded number per model, each up to `hold_s`; past either, 503 with `Retry-After`) while
the orchestrator is asked for a worker (`fleet.model_waker`), and routed when one registers
(a disaggregated one's, once its prefill worker did too: `awaits_prefill`). A resumed
request does not wait (the client's stream is open and stalled) but for a few seconds after
a NATS reconnect, while the workers re-register (`resumed_deadline`).

Caller: `flows.opener.SourceOpener`, between the routing attempts of one request.
"""

from __future__ import annotations

import asyncio

from services.router.config import ScaleFromZeroConfig
from services.router.fleet.model_waker import ModelWaker
from services.router.fleet.worker_pool import WorkerPool
from services.router.flows.records import Clock, GenerationParams
from services.router.metrics import RouterMetrics
from services.router.openai.errors import NoWorkerYet
from services.router.routing import RoutePlan, WorkerView
from services.router.routing.cold_start import ColdStarts, Hold, HoldRefused
from shared.errors import Unavailable


class WorkerWait:
    def __init__(self, pool: WorkerPool, *, clock: Clock, worker_wait_s: float, metrics: RouterMetrics,
                 scale_from_zero: ScaleFromZeroConfig = ScaleFromZeroConfig(),
                 waker: ModelWaker | None = None) -> None:
        self._pool = pool
        self._clock = clock
        self._worker_wait_s = worker_wait_s
        self._scale_from_zero = scale_from_zero
        self._cold_starts = ColdStarts.of(scale_from_zero)
        assert waker is not None or not self._cold_starts.models, "scalable models need a waker"
        metrics.held.set_function(self._cold_starts.total_held)
        self._waker = waker

    def resumed_deadline(self) -> float:
        """Until when a resumed request may wait: now, or a little longer just after a NATS
        reconnect (`WorkerPool.resync_wait_s`)."""
        return self._clock() + self._pool.resync_wait_s()

    def scalable(self, model: str) -> bool:
        return self._cold_starts.scalable(model)

    def awaits_prefill(self, model: str, views: list[WorkerView], plan: RoutePlan) -> bool:
        """A held request's model whose decode worker is up first: wait for the prefill one."""
        return self._waker is not None and self._cold_starts.awaits_prefill(
            model, views, whole=plan.prefill_worker_id is None, waking=self._waker.waking(model))

    def hold(self, params: GenerationParams) -> Hold:
        """Admit a scalable model's request to wait for a worker to start; raises `NoWorkerYet`
        (503, Retry-After) when too many wait already."""
        held = self._cold_starts.hold(params.model, params.arrived_at)
        if isinstance(held, HoldRefused):
            raise NoWorkerYet(f"no worker serves model {params.model!r} yet and {held.reason}; retry later",
                              retry_after_s=self._scale_from_zero.retry_after_s)
        return held

    def release(self, model: str, *, routed: bool) -> None:
        """A held request of `model` stops waiting: `routed`, or given up."""
        self._cold_starts.release(model, routed=routed)

    async def wait(self, params: GenerationParams, deadline: float, hold: Hold | None) -> None:
        """Until the membership changes (while held: or the orchestrator answers, or the next
        ask for a worker is due); past `deadline`, `Unavailable`. A held request gets
        `NoWorkerYet` (503 with `Retry-After`) past its deadline, or at once when the
        orchestrator refused to start a worker of its model."""
        now = self._clock()
        remaining = deadline - now
        if hold is None or self._waker is None:
            if remaining <= 0:
                raise Unavailable(f"no worker is available for model {params.model!r} "
                                  f"(waited {self._worker_wait_s:g}s)")
            await self._pool.wait_for_change(remaining)
            return
        waker, retry_after_s = self._waker, self._scale_from_zero.retry_after_s
        refusal = waker.refusal(params.model)
        if refusal:
            raise NoWorkerYet(f"no worker serves model {params.model!r} and none is starting: {refusal}",
                              retry_after_s=retry_after_s)
        if remaining <= 0:
            raise NoWorkerYet(f"no worker of model {params.model!r} started within "
                              f"{self._scale_from_zero.hold_s:g}s", retry_after_s=retry_after_s)
        if self._cold_starts.should_ask(params.model, now):
            waker.wake(params.model)
        wait_s = min(remaining, self._scale_from_zero.ask_every_s)
        waits = [asyncio.ensure_future(self._pool.wait_for_change(wait_s)),
                 asyncio.ensure_future(waker.wait_for_answer(wait_s))]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
