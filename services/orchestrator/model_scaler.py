"""Scalable models back to zero workers (adapter around the pure `idle_models`).

With `scale_to_zero.idle_s` set, the orchestrator watches the router's request records
(`requests.events`) and the workers' load reports (a `cluster_watcher.ClusterWatcher`): a record of a scalable model, or a load
report of one of its workers with a request running or waiting, is the model's activity.
Every `interval_s` it asks `IdleModels` which scalable models had none for `idle_s`, and
removes each one's workers that its launcher started (`ControlPlane.remove`: drain, then stop
the process), so only workers it can start again are stopped; a worker started by other
means stays. The scale-up is the other half: a router's `WakeModel` (`control_plane`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from services.orchestrator.cluster_watcher import ClusterWatcher
from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.control_plane import ControlPlane
from services.orchestrator.idle_models import IdleModel, IdleModels
from shared.bus import Bus
from shared.codec import MalformedCounter
from shared.schemas import LoadSnapshot, RequestRecord, WorkerRegistration

log = logging.getLogger(__name__)


class ModelScaler(ClusterWatcher):
    name = "model-scaler"

    def __init__(self, config: OrchestratorConfig, bus: Bus, members: Callable[[], Mapping[str, WorkerRegistration]],
                 control: ControlPlane, malformed: MalformedCounter, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config, bus, members, control, malformed, interval_s=config.scale_to_zero.interval_s,
                         clock=clock)
        self._config = config.scale_to_zero
        self.idle_models = IdleModels(models=frozenset(self._config.scalable()), idle_s=self._config.idle_s)
        self._removing: set[str] = set()  # workers being drained and stopped
        self._tasks: set[asyncio.Task[None]] = set()
        self.scaled_down: list[IdleModel] = []  # in order, for the log and tests

    async def start(self) -> None:
        await super().start()
        log.info("scale to zero: %s after %g s without a request", ", ".join(sorted(self.idle_models.models)),
                 self._config.idle_s)

    def _own_tasks(self) -> tuple[asyncio.Task[None], ...]:
        return tuple(self._tasks)

    def _on_snapshot(self, snapshot: LoadSnapshot) -> None:
        registration = self._members().get(snapshot.worker_id)
        if registration is not None and snapshot.running + snapshot.waiting > 0:
            self.idle_models.active(registration.model, self._clock())

    def _on_record(self, record: RequestRecord) -> None:
        self.idle_models.active(record.model, self._clock())

    async def _tick(self) -> None:
        self.tick()

    def tick(self) -> list[IdleModel]:
        """Start stopping the idle models' workers; returns the models found idle."""
        members = self._members()
        workers: dict[str, list[str]] = {}
        for worker_id in self._control.launched():
            registration = members.get(worker_id)
            if registration is not None and worker_id not in self._removing:
                workers.setdefault(registration.model, []).append(worker_id)
        idle = self.idle_models.idle(workers, self._clock())
        for model in idle:
            log.info("model %s had no request for %.1f s: stopping its workers %s", model.model, model.idle_for_s,
                     ", ".join(model.worker_ids))
            self.scaled_down.append(model)
            for worker_id in model.worker_ids:
                self._removing.add(worker_id)
                task = asyncio.create_task(self._remove(worker_id), name=f"scale-to-zero:{worker_id}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        return idle

    async def _remove(self, worker_id: str) -> None:
        try:
            outcome = await self._control.remove(worker_id, self._config.drain_deadline_s)
            log.info("scale to zero: worker %s %s (%s)", worker_id, outcome.outcome, outcome.reason)
        finally:
            self._removing.discard(worker_id)
