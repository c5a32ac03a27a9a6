"""The router's admission queue: which request starts when a slot frees, who is refused. Pure.

The caller (`services.router.flows.admission`) passes the fleet's `capacity` (requests the
router lets run at once) with each call; the queue counts what runs. Order: the most urgent
priority first (lower numbers, vLLM's convention); within a priority the key with the least
virtual token counter (`fair_share`); within a key, first come first served. Without keys and
priorities that is plain first come first served.

Refusals are values (`Pushed.refused`), the caller answers them 429:
- a sheddable request never waits: it starts at once or is refused;
- a full queue sheds whoever would be served last (the least urgent priority, the key whose
  counter would be greatest once its waiting requests were served, its newest request), which
  may be the new request itself.
Less urgent requests (priority >= 0) may not take the last `reserve_share` of the slots: an
urgent request finds one free at once instead of waiting for a running request to end.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass

from services.router.routing.admission.fair_share import VirtualTokenCounters
from services.router.routing.admission.tenant import DEFAULT_PRIORITY, Tenant
from services.router.routing.config import AdmissionConfig


@dataclass(frozen=True, slots=True)
class Ask:
    """One request asking to start."""

    request_id: str
    tenant: Tenant
    cost: float  # its estimated service (`fair_share.service_tokens` of the prompt and max_tokens)
    sheddable: bool = False


@dataclass(frozen=True, slots=True)
class Pushed:
    start: bool  # the pushed request starts now
    refused: tuple[Ask, ...] = ()  # refused: the pushed request, or a queued one shed for it


class AdmissionQueue:
    def __init__(self, config: AdmissionConfig) -> None:
        self._config = config
        self.counters = VirtualTokenCounters()
        self.running = 0
        self._waiting: dict[int, dict[str, deque[tuple[int, Ask]]]] = {}  # priority -> key -> (order, ask)
        self._queued = 0
        self._order = itertools.count()

    def __len__(self) -> int:
        """Requests waiting."""
        return self._queued

    def limit(self, priority: int, capacity: int) -> int:
        """How many may run at once when the next to start has `priority`."""
        if priority < DEFAULT_PRIORITY or self._config.reserve_share == 0:
            return capacity
        return max(1, math.floor(capacity * (1.0 - self._config.reserve_share)))

    def push(self, ask: Ask, capacity: int) -> Pushed:
        priority, key = ask.tenant.priority, ask.tenant.key
        self.counters.activate(key)
        ahead = any(band <= priority for band in self._waiting)
        if not ahead and self.running < self.limit(priority, capacity):
            self._start(ask)
            return Pushed(start=True)
        if ask.sheddable:
            self.counters.deactivate(key)
            return Pushed(start=False, refused=(ask,))
        if self._queued < self._config.max_queued:
            self._enqueue(ask)
            return Pushed(start=False)
        victim = self._last_in_line()
        if victim is not None and self._served_after(victim, ask):
            self._remove(victim)
            self._enqueue(ask)
            return Pushed(start=False, refused=(victim,))
        self.counters.deactivate(key)
        return Pushed(start=False, refused=(ask,))

    def pop(self, capacity: int) -> list[Ask]:
        """The waiting requests that start now, in order (each counted running)."""
        started = []
        while self._waiting:
            priority = min(self._waiting)
            if self.running >= self.limit(priority, capacity):
                break
            keys = self._waiting[priority]
            key = min(keys, key=lambda name: (self.counters.counter(name), keys[name][0][0]))
            _, ask = keys[key].popleft()
            self._forget_if_empty(priority, key)
            self._queued -= 1
            self._start(ask)
            started.append(ask)
        return started

    def finish(self, ask: Ask, served: float) -> None:
        """A started request ended, having been served `served` (`fair_share.service_tokens`)."""
        assert self.running > 0, "finish without a running request"
        self.running -= 1
        self.counters.charge(ask.tenant.key, served - ask.cost, ask.tenant.weight)
        self.counters.deactivate(ask.tenant.key)

    def withdraw(self, ask: Ask) -> bool:
        """Take a waiting request out (its client left, or it waited too long); False: not waiting."""
        lane = self._waiting.get(ask.tenant.priority, {}).get(ask.tenant.key)
        if lane is None or not any(queued is ask for _, queued in lane):
            return False
        self._remove(ask)
        return True

    def _start(self, ask: Ask) -> None:
        self.running += 1
        self.counters.charge(ask.tenant.key, ask.cost, ask.tenant.weight)  # corrected by `finish`

    def _enqueue(self, ask: Ask) -> None:
        lane = self._waiting.setdefault(ask.tenant.priority, {}).setdefault(ask.tenant.key, deque())
        lane.append((next(self._order), ask))
        self._queued += 1

    def _remove(self, ask: Ask) -> None:
        priority, key = ask.tenant.priority, ask.tenant.key
        lane = self._waiting[priority][key]
        lane.remove(next(entry for entry in lane if entry[1] is ask))
        self._forget_if_empty(priority, key)
        self._queued -= 1
        self.counters.deactivate(key)

    def _forget_if_empty(self, priority: int, key: str) -> None:
        keys = self._waiting[priority]
        if not keys[key]:
            del keys[key]
            if not keys:
                del self._waiting[priority]

    def _last_in_line(self) -> Ask | None:
        if not self._waiting:
            return None
        priority = max(self._waiting)
        keys = self._waiting[priority]
        key = max(keys, key=lambda name: (self._finish_line(priority, name), keys[name][-1][0]))
        return keys[key][-1][1]

    def _finish_line(self, priority: int, key: str) -> float:
        """Where `key`'s counter would stand once its requests waiting at `priority` were served."""
        lane = self._waiting.get(priority, {}).get(key, ())
        return self.counters.counter(key) + sum(ask.cost / ask.tenant.weight for _, ask in lane)

    def _served_after(self, queued: Ask, pushed: Ask) -> bool:
        """Whether `queued` would be served after `pushed`: less urgent, or its key would have been
        served more by then."""
        if queued.tenant.priority != pushed.tenant.priority:
            return queued.tenant.priority > pushed.tenant.priority
        priority = pushed.tenant.priority
        pushed_line = self._finish_line(priority, pushed.tenant.key) + pushed.cost / pushed.tenant.weight
        return self._finish_line(priority, queued.tenant.key) > pushed_line
