"""Holding requests for a model with no worker (pure; `flows.worker_wait` asks, a waker acts).

A scalable model (`ScaleFromZeroConfig.models`) may have no worker that can take a request.
Its requests are then held: at most `max_held` at a time per model (past that, the answer is
503 with `Retry-After`), each until `hold_s` after its arrival. The first held request asks
for a worker to be started; while requests stay held, the ask is repeated every `ask_every_s`
(a start that failed, a worker that left before serving them). Once one of a model's held
requests is routed, the next hold asks at once. A disaggregated scalable model (`@<P>p<D>d`)
wakes as prefill and decode workers started together: while that wake is under way, a held
request is not served whole by a decode worker that came up before any prefill worker
(`awaits_prefill`), so that it is served disaggregated once both are up. No clock is read:
callers pass `now`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from services.router.routing.config import ScaleFromZeroConfig
from services.router.routing.view import WorkerView
from shared.schemas import WorkerRole, WorkerStatus


@dataclass(frozen=True, slots=True)
class Hold:
    """A request admitted to wait for a worker, until `deadline`."""

    deadline: float


@dataclass(frozen=True, slots=True)
class HoldRefused:
    reason: str


@dataclass
class ColdStarts:
    models: frozenset[str]  # the scalable ones
    max_held: int  # per model
    hold_s: float  # a held request's wait, from its arrival
    ask_every_s: float  # how often a model with held requests asks for a worker again
    disaggregated: frozenset[str] = frozenset()  # the scalable ones that wake as prefill + decode workers
    _held: dict[str, int] = field(default_factory=dict)
    _asked_at: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, config: ScaleFromZeroConfig) -> ColdStarts:
        scalable = config.scalable()
        return cls(models=frozenset(scalable), max_held=config.max_held, hold_s=config.hold_s,
                   ask_every_s=config.ask_every_s,
                   disaggregated=frozenset(name for name, model in scalable.items() if model.disaggregated))

    def scalable(self, model: str) -> bool:
        return model in self.models

    def held(self, model: str) -> int:
        return self._held.get(model, 0)

    def total_held(self) -> int:
        return sum(self._held.values())

    def hold(self, model: str, arrived_at: float) -> Hold | HoldRefused:
        """Admit one request of a scalable `model` that no worker can take now."""
        assert model in self.models, model
        held = self._held.get(model, 0)
        if held >= self.max_held:
            return HoldRefused(f"{held} requests for model {model!r} already wait for a worker to start")
        self._held[model] = held + 1
        return Hold(deadline=arrived_at + self.hold_s)

    def awaits_prefill(self, model: str, views: Iterable[WorkerView], *, whole: bool, waking: bool) -> bool:
        """Whether a held request of `model`, which `views` would serve `whole` (on one worker),
        waits on: its model is disaggregated, its wake is under way and no prefill worker of it is
        up yet (once the wake is over, answered and its workers seen here or given up on
        (`fleet.model_waker.ModelWaker.waking`), the request takes what serves it)."""
        return whole and waking and model in self.disaggregated and not any(
            view.model == model and view.role is WorkerRole.PREFILL and view.status is WorkerStatus.ACTIVE
            for view in views)

    def should_ask(self, model: str, now: float) -> bool:
        """Whether a held request of `model` asks for a worker now (and counts as the ask)."""
        asked = self._asked_at.get(model)
        if asked is not None and now - asked < self.ask_every_s:
            return False
        self._asked_at[model] = now
        return True

    def release(self, model: str, *, routed: bool) -> None:
        """A held request leaves: routed to a worker, or failed (deadline, cancelled)."""
        held = self._held.get(model, 0) - 1
        assert held >= 0, model
        if held:
            self._held[model] = held
        else:
            self._held.pop(model, None)
        if routed:  # the model has a worker: when it has none again, the first hold asks at once
            self._asked_at.pop(model, None)
