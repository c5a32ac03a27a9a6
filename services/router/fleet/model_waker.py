"""Asking the orchestrator for a worker of a scalable model (adapter): a `WakeModel` request
on `orchestrator.wake`, sent in the background, its `CommandOutcome` logged and kept.

The worker wait (`flows.worker_wait`) calls `wake(model)` when it holds a request that no worker can take
(`services.router.routing.cold_start` says when); the held requests themselves wait on the
worker pool's membership, not on this answer. The orchestrator's refusal (a model it does not
start, no launcher, the worker budget) is kept as `refusal(model)`: the held requests, woken
by the answer (`wait_for_answer`), get a 503 with `Retry-After` naming it at once, since no
worker is coming; the next answer that is not a refusal clears it. `waking(model)` says
whether an ask is still under way (a P/D model's held requests wait for its prefill worker
meanwhile: `cold_start.awaits_prefill`). The orchestrator answers `ok` once the workers it
started are ACTIVE in its own view of the members bucket; this router's watch of that bucket
may deliver them a moment later (a loaded host or server). So a wake stays under way until
every worker its answer names is ACTIVE here too, at most `view_wait_s` after the answer:
else a P/D model's held requests, woken by the answer while only its decode worker is seen
here, would be served whole.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from shared.bus import Bus
from shared.codec import Codec, MalformedCounter, encode
from shared.schemas.orchestrator import CommandOutcome, WakeModel
from shared.subjects import Subjects

log = logging.getLogger(__name__)


class Members(Protocol):
    """This router's view of the members (`WorkerPool`)."""

    def is_active(self, worker_id: str) -> bool: ...

    async def wait_for_change(self, timeout_s: float) -> None: ...


class ModelWaker:
    def __init__(self, bus: Bus, subjects: Subjects, malformed: MalformedCounter, members: Members, *,
                 timeout_s: float, view_wait_s: float) -> None:
        self._bus = bus
        self._members = members
        self._view_wait_s = view_wait_s  # after an `ok`, how long its workers may take to show up here
        self._subject = subjects.orchestrator_wake
        self._outcomes: Codec[CommandOutcome] = Codec(CommandOutcome, malformed)
        self._timeout_s = timeout_s  # the worker's start and registration, bounded by the hold
        self._asking: set[asyncio.Task[None]] = set()
        self._refusals: dict[str, str] = {}
        self._answered = asyncio.Event()  # set (and replaced) at each answer
        self._waking: dict[str, int] = {}  # each model's wake requests not yet answered
        self.asked = 0  # wake requests sent

    def wake(self, model: str) -> None:
        self.asked += 1
        self._waking[model] = self._waking.get(model, 0) + 1
        task = asyncio.create_task(self._ask(model), name=f"wake:{model}")
        self._asking.add(task)
        task.add_done_callback(self._asking.discard)

    def waking(self, model: str) -> bool:
        """Whether a wake of `model` is under way: asked, and neither given up nor answered (an
        `ok` once the workers it names are seen here, or `view_wait_s` after it)."""
        return model in self._waking

    def _answered_one(self, model: str) -> None:
        left = self._waking.pop(model, 1) - 1
        if left:
            self._waking[model] = left

    async def wait_for_answer(self, timeout_s: float) -> None:
        """Return when the orchestrator answers a wake, or after `timeout_s`."""
        try:
            await asyncio.wait_for(self._answered.wait(), timeout_s)
        except TimeoutError:
            pass

    def refusal(self, model: str) -> str:
        """Why the orchestrator would not start a worker of `model`, by its last answer ("": none)."""
        return self._refusals.get(model, "")

    async def _ask(self, model: str) -> None:
        log.info("no worker serves model %s: asking the orchestrator to start one", model)
        try:
            outcome = await self._request(model)
            if outcome is not None and outcome.ok:
                await self._until_seen(model, outcome)
        finally:  # before the answer wakes the held requests: they see the wake is over
            self._answered_one(model)
        if outcome is None:
            return
        if outcome.outcome == "refused":
            self._refusals[model] = outcome.reason
            log.warning("the orchestrator will not start a worker of model %s: %s", model, outcome.reason)
        else:
            self._refusals.pop(model, None)
            log.info("worker of model %s: %s (%s)", model, outcome.outcome, outcome.reason.splitlines()[0]
                     if outcome.reason else "")
        self._answered.set()
        self._answered = asyncio.Event()

    async def _request(self, model: str) -> CommandOutcome | None:
        """The orchestrator's answer to a wake of `model`; None without one."""
        try:
            reply = await self._bus.client.request(self._subject, encode(WakeModel(model=model)),
                                                   timeout=self._timeout_s)
        except Exception as error:  # no orchestrator, a timeout: the held requests wait on membership anyway
            log.warning("asking for a worker of model %s: %s %s", model, type(error).__name__, error)
            return None
        return self._outcomes.decode_or_none(reply.data, self._subject)

    async def _until_seen(self, model: str, outcome: CommandOutcome) -> None:
        """Until every worker `outcome` names is ACTIVE in this router's view, at most `view_wait_s`."""
        named = [summary.registration.worker_id for summary in outcome.workers]
        deadline = time.monotonic() + self._view_wait_s
        while unseen := [worker_id for worker_id in named if not self._members.is_active(worker_id)]:
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("the orchestrator started %s for model %s, but this router does not see %s active "
                            "%gs later", ", ".join(named), model, ", ".join(unseen), self._view_wait_s)
                return
            await self._members.wait_for_change(left)

    async def stop(self) -> None:
        for task in self._asking:
            task.cancel()
        await asyncio.gather(*self._asking, return_exceptions=True)
