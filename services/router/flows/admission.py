"""The router's admission gate (the adapter around `routing.admission`).

`Dispatcher.dispatch` passes each new request through `enter()` before routing it, and
`leave()` once its generation closed (with what it used). The gate
- checks the request's API key's tokens per minute (`TokenBudgets`): past it, 429
  `rate_limited` with `Retry-After`;
- when the admission queue is on (`AdmissionConfig.slots_per_seq` > 0), lets at most the
  model's capacity (`admission_capacity`, over the worker pool's views) run at once, one
  `AdmissionQueue` per model; the others wait on a future, in the policy's order, for at
  most `max_wait_s`. A refusal (sheddable, shed from a full queue, waited too long) is
  `TooManyRequests` (429 with `Retry-After`). A client that leaves while waiting leaves
  the queue. With no worker serving the model yet, nothing waits here (the router's
  own wait for a worker applies, `flows.worker_wait`).
Resumed requests do not pass the gate again: they keep their slot.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.router.config import AdmissionConfig
from services.router.flows.records import Clock, GenerationParams, TokenUsage
from services.router.openai.errors import TooManyRequests
from services.router.routing import WorkerView
from services.router.routing.admission import AdmissionQueue, Ask, TokenBudgets
from services.router.routing.admission.capacity import admission_capacity
from services.router.routing.admission.fair_share import service_tokens
from services.router.routing.admission.token_budget import whole_seconds


@dataclass(frozen=True)
class Ticket:
    """A request let through: its slot in its model's queue (None: the queue is off), and the
    tokens its key's budget was charged."""

    model: str
    key: str
    ask: Ask | None
    budget_tokens: int


class AdmissionGate:
    def __init__(self, config: AdmissionConfig, views: Callable[[], Sequence[WorkerView]], clock: Clock, *,
                 retry_after: int) -> None:
        self._config = config
        self._views = views
        self._clock = clock
        self._retry_after = retry_after
        self._queues: dict[str, AdmissionQueue] = {}
        self._waiting: dict[str, asyncio.Future[None]] = {}  # request id -> its start
        self._budgets = TokenBudgets()

    def waiting(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    async def enter(self, params: GenerationParams) -> Ticket:
        """The request's ticket once it may be routed; raises `TooManyRequests`."""
        tenant = params.tenant
        estimate = len(params.prompt_ids) + params.sampling.max_tokens
        if tenant.tokens_per_minute is not None:
            wait_s = self._budgets.take(tenant.key, tenant.tokens_per_minute, estimate, self._clock())
            if wait_s > 0:
                raise TooManyRequests(f"Token rate limit reached for API key '{tenant.key}' "
                                      f"({tenant.tokens_per_minute} tokens/min).",
                                      retry_after_s=whole_seconds(wait_s), api_code="rate_limited")
        budget_tokens = estimate if tenant.tokens_per_minute is not None else 0
        capacity = self._capacity(params.model)
        if capacity == 0:
            return Ticket(params.model, tenant.key, None, budget_tokens)
        queue = self._queue(params.model)
        sheddable = self._config.sheddable_priority is not None and tenant.priority >= self._config.sheddable_priority
        ask = Ask(params.request_id, tenant, service_tokens(len(params.prompt_ids), params.sampling.max_tokens),
                  sheddable)
        pushed = queue.push(ask, capacity)
        ticket = Ticket(params.model, tenant.key, ask, budget_tokens)
        try:
            for refused in pushed.refused:
                if refused is ask:
                    raise self._overloaded(params.model, "its queue is full" if not sheddable else
                                           "no slot is free for a sheddable request")
                self._waiting.pop(refused.request_id).set_exception(
                    self._overloaded(params.model, "more urgent requests took its place"))
            if not pushed.start:
                await self._wait(queue, ask, params.model)
        except BaseException:
            self._give_back_budget(ticket, 0)
            raise
        finally:
            self._start_waiting(params.model, queue)
        return ticket

    def leave(self, ticket: Ticket, usage: TokenUsage | None) -> None:
        """The request ended, having used `usage` (None: nothing reached a worker)."""
        prompt, completion = (usage.prompt_tokens, usage.completion_tokens) if usage is not None else (0, 0)
        self._give_back_budget(ticket, prompt + completion)
        if ticket.ask is not None:
            queue = self._queues[ticket.model]
            queue.finish(ticket.ask, service_tokens(prompt, completion))
            self._start_waiting(ticket.model, queue)

    async def _wait(self, queue: AdmissionQueue, ask: Ask, model: str) -> None:
        started = asyncio.get_running_loop().create_future()
        self._waiting[ask.request_id] = started
        try:
            async with asyncio.timeout(self._config.max_wait_s):
                await asyncio.shield(started)
        except TimeoutError:
            if queue.withdraw(ask):
                self._waiting.pop(ask.request_id, None)
                raise self._overloaded(model, f"it waited {self._config.max_wait_s:g}s") from None
            await started  # it started (or was shed) as the time ran out
        except asyncio.CancelledError:  # the client left
            if queue.withdraw(ask):
                self._waiting.pop(ask.request_id, None)
            elif started.done() and started.exception() is None:
                queue.finish(ask, 0.0)  # it had just started: nothing was served
            raise

    def _start_waiting(self, model: str, queue: AdmissionQueue) -> None:
        for ask in queue.pop(self._capacity(model)):
            self._waiting.pop(ask.request_id).set_result(None)

    def _give_back_budget(self, ticket: Ticket, used_tokens: int) -> None:
        if ticket.budget_tokens:
            self._budgets.correct(ticket.key, ticket.budget_tokens - used_tokens, self._clock())

    def _capacity(self, model: str) -> int:
        if self._config.slots_per_seq <= 0:
            return 0
        return admission_capacity(self._views(), model, self._config.slots_per_seq)

    def _queue(self, model: str) -> AdmissionQueue:
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = AdmissionQueue(self._config)
        return queue

    def _overloaded(self, model: str, why: str) -> TooManyRequests:
        return TooManyRequests(f"the router's admission queue for {model!r} refused the request: {why}; "
                               f"retry later", retry_after_s=self._retry_after)
