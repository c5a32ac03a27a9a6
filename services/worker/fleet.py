"""A fleet of simulated workers in one process (`tandem worker-fleet`).

Each worker of the fleet is a plain `WorkerService` over its own `SimEngine`: its own id,
registration and heartbeats, KV pool, KV event and load streams, request and control
subjects, and (with KV transfer on) its own data plane; the in-memory transport lets
workers of the fleet pull KV from each other. What the workers share is what costs per
process, not per worker:

- the NATS connections (`FleetConfig.connections`, the workers spread over them);
- the tokenizer (for the vocabulary size) and the sim's timing profile, loaded once;
- one `FleetTicker` for the heartbeats and load snapshots of all of them, and one task
  flushing KV events, instead of three timer tasks per worker. KV events are flushed every
  `kv_event_interval_s` from the workers running requests (and once after), and from every
  worker just before its load snapshot: an idle worker costs nothing at the KV event rate.

Workers start and stop in groups of `start_concurrency`. A worker told to drain leaves on
its own (as a lone worker would: it deregisters and stops its engine); the fleet runs until
every worker has left or it is told to stop (SIGTERM/SIGINT), then drains the rest.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from services.worker.config import FleetConfig
from services.worker.fleet_ticker import FleetTicker
from services.worker.main import build_kv
from services.worker.service import WorkerService
from services.worker.sim.engine import SimEngine
from services.worker.sim.profile import load_profile
from services.worker.sim.spec import SIM
from shared.bus import Bus, connect
from shared.lifecycle import reraise_if_cancelling, stop_on_signals
from shared.tokenizer import Tokenizer
from shared.tracing import setup_tracing

log = logging.getLogger(__name__)

T = TypeVar("T")


async def in_groups(items: Sequence[T], size: int, action: Callable[[T], Awaitable[None]]) -> None:
    """`action` for every item, `size` at a time."""
    for first in range(0, len(items), size):
        await asyncio.gather(*(action(item) for item in items[first:first + size]))


class WorkerFleet:
    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.services: list[WorkerService] = []
        self._buses: list[Bus] = []
        self._started: list[WorkerService] = []
        self._serving: list[bool] = []  # per worker: started and registered
        self._ready: list[WorkerService] = []  # started and registered, in start order
        self._flusher: asyncio.Task[None] | None = None
        self._ticker: FleetTicker | None = None
        self._watchers: list[asyncio.Task[None]] = []
        self.stopped = asyncio.Event()  # every worker has stopped

    @property
    def worker_ids(self) -> list[str]:
        return [service.worker_id for service in self.services]

    async def start(self) -> None:
        config, template = self.config, self.config.worker
        self._buses = [await connect(template.bus, f"worker-fleet-{index}") for index in range(config.connections)]
        tokenizer = Tokenizer.from_model_dir(template.model_dir)
        model_name = template.served_model_name or tokenizer.model_name
        profile = load_profile(config.sim.profile)
        for offset in range(config.count):
            worker = config.worker_config(config.first_index + offset)
            bus = self._buses[offset % len(self._buses)]
            engine = SimEngine(worker, config.sim, model_name=model_name, vocab_size=tokenizer.vocab_size,
                               profile=profile)
            self.services.append(WorkerService(worker, engine, bus, build_kv(worker, SIM, engine, bus),
                                               capabilities=SIM.capabilities))
        self._serving = [False] * len(self.services)
        # The ticker runs from the start: the first workers heartbeat while the last ones start.
        ticker = FleetTicker(len(self.services), self._live)
        ticker.every("heartbeat", template.membership.heartbeat_interval_s,
                     lambda index: self.services[index].heartbeat(), concurrent=True)
        ticker.every("load", template.load_interval_s, self._flush_and_publish_load)
        if template.caller_check_interval_s > 0:
            ticker.every("callers", template.caller_check_interval_s,
                         lambda index: self.services[index].callers.sweep(), concurrent=True)
        self._ticker = ticker
        self._flusher = asyncio.create_task(self._flush_busy_forever(template.kv_event_interval_s),
                                            name="fleet-kv-events")
        await in_groups(range(len(self.services)), config.start_concurrency, self._start_one)
        self._watchers = [asyncio.create_task(self._watch(service)) for service in self.services]
        log.info("fleet of %d sim workers serving (%s .. %s) over %d NATS connection(s)", len(self.services),
                 self.services[0].worker_id, self.services[-1].worker_id, len(self._buses))

    async def _start_one(self, index: int) -> None:
        service = self.services[index]
        await service.engine.start()
        self._started.append(service)  # from here on, stop() stops it
        await service.start(timers=False)
        self._serving[index] = True
        self._ready.append(service)

    async def _flush_busy_forever(self, interval_s: float) -> None:
        """Every `interval_s`, the KV events of the workers running requests, or that did at
        the previous tick (what their last step left). One pass over the fleet is a list
        comprehension, not a call per worker: most of a large fleet is idle at any moment,
        and an idle worker's events (a late eviction) go out with its next load snapshot."""
        was_busy: list[WorkerService] = []
        while True:
            await asyncio.sleep(interval_s)
            busy = [service for service in self._ready if service.inflight]
            for service in dict.fromkeys(was_busy + busy):
                if service.stopped.is_set():
                    continue
                try:
                    await service.flush_kv_events()
                except Exception as error:  # NATS reconnecting: the next tick tries again
                    reraise_if_cancelling(error)
                    log.debug("KV events of %s: %s", service.worker_id, error)
            was_busy = busy

    async def _flush_and_publish_load(self, index: int) -> None:
        service = self.services[index]
        await service.flush_kv_events()
        await service.publish_load()

    def _live(self, index: int) -> bool:
        """Whether worker `index` has periodic work: started, and not stopped since."""
        return self._serving[index] and not self.services[index].stopped.is_set()

    async def _watch(self, service: WorkerService) -> None:
        await service.stopped.wait()
        if all(other.stopped.is_set() for other in self.services):
            self.stopped.set()

    async def stop(self) -> None:
        """Drain and deregister every worker still running, then close the connections."""
        if self._ticker is not None:
            await self._ticker.stop()
        if self._flusher is not None:
            self._flusher.cancel()
            await asyncio.gather(self._flusher, return_exceptions=True)
        for watcher in self._watchers:
            watcher.cancel()
        running = [service for service in self._started if not service.stopped.is_set()]
        if running:
            log.info("fleet stopping: %d worker(s) still running", len(running))
        await in_groups(running, self.config.start_concurrency, self._stop_one)
        for bus in self._buses:
            await bus.close()
        self.stopped.set()

    async def _stop_one(self, service: WorkerService) -> None:
        try:
            await service.stop()
        except Exception:  # one worker's failure must not keep the others running
            log.exception("worker %s did not stop cleanly", service.worker_id)


async def run_fleet(config: FleetConfig, *, ready: asyncio.Event | None = None) -> None:
    config.validate()
    template = config.worker
    setup_tracing("tandem-worker-fleet", template.tracing.exporter, template.tracing.otlp_endpoint)
    fleet = WorkerFleet(config)
    # The handlers stay installed through the stop: a second SIGTERM must not kill the
    # process half-way through deregistering the fleet.
    with stop_on_signals() as stop_requested:
        try:
            await fleet.start()
            # What the fleet built lives as long as the process (per worker: block tables,
            # subscriptions, codecs): out of the collector's sight, a full collection no
            # longer walks all of it (at 1024 workers that stalled the loop for ~0.2 s).
            gc.collect()
            gc.freeze()
            if ready is not None:
                ready.set()
            stopped = asyncio.create_task(fleet.stopped.wait())
            requested = asyncio.create_task(stop_requested.wait())
            await asyncio.wait({stopped, requested}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            requested.cancel()
        finally:
            await fleet.stop()
