"""When a scalable model is idle (pure; the orchestrator's `model_scaler` feeds it and acts).

A model is active at each request of it the router records, at each load report of one of
its workers with a request running or waiting (a long request is activity before its record),
and when a worker of it starts. `IdleModels` keeps each scalable model's last activity;
`idle(workers, now)` names the models that have workers this orchestrator may stop and had
no activity for `idle_s`. A model seen with workers after having none (its first worker
started, or this orchestrator just started) counts as active at that moment: a new worker
gets a full idle period, whatever records of its model's past arrive late.
No clock is read: callers pass `now` (monotonic seconds).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class IdleModel:
    model: str
    worker_ids: tuple[str, ...]  # its workers to drain and stop
    idle_for_s: float


@dataclass
class IdleModels:
    models: Collection[str]  # the scalable models: no other model is ever scaled down
    idle_s: float
    _last_active: dict[str, float] = field(default_factory=dict)
    _with_workers: set[str] = field(default_factory=set)  # models that had workers at the last look

    def active(self, model: str, now: float) -> None:
        """A request of `model`, a busy worker of it, or a worker of it starting, at `now`."""
        if model in self.models:
            self._last_active[model] = max(now, self._last_active.get(model, now))

    def last_active(self, model: str) -> float | None:
        return self._last_active.get(model)

    def idle(self, workers: Mapping[str, Collection[str]], now: float) -> list[IdleModel]:
        """`workers`: each model's workers that may be stopped (started by this orchestrator's
        launcher, not yet being stopped). The scalable ones among them idle for `idle_s`; a
        model that had none until now is active now (its first requests may not show yet)."""
        idle = []
        for model in sorted(self.models):
            worker_ids = workers.get(model, ())
            if not worker_ids:
                self._with_workers.discard(model)
                continue
            if model not in self._with_workers:
                self._with_workers.add(model)
                self.active(model, now)
            last = self._last_active[model]
            if self.idle_s > 0 and now - last >= self.idle_s:
                idle.append(IdleModel(model=model, worker_ids=tuple(sorted(worker_ids)), idle_for_s=now - last))
        return idle
