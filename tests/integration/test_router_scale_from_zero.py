"""The router holding a scalable model's requests while it has no worker, against a real
nats-server and real sim workers, with the orchestrator's side of `orchestrator.wake` played
by the test: held requests are answered once the worker the wake asked for registers (one
wake for all of them), as is one refused by a worker that began its idle drain; past the queue bound a request is a 503 with `Retry-After` at once;
the orchestrator's refusal ends the hold at once; with nobody to answer, the hold ends at its
deadline, a 503 with `Retry-After`, never a hang. A P/D model's (`@1p1d`) held requests wait
for its prefill worker when the decode worker registers first, and are served disaggregated,
also when the orchestrator's answer comes before this router sees the prefill worker it names
(a named worker that never shows up ends that wait `view_wait_s` after the answer)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import msgspec
import pytest
from nats.aio.msg import Msg

from services.router.config import RoutingConfig, ScaleFromZeroConfig
from services.router.routing.config import ALWAYS_SPLIT
from shared.bus import Bus
from shared.codec import Codec, encode
from shared.config import BusConfig
from shared.schemas import WorkerRole
from shared.schemas.orchestrator import CommandOutcome, OrchestratorCommand, WakeModel, WorkerSummary
from tests.integration.router_cluster import (
    DEADLINE_S,
    Router,
    SimWorker,
    metrics_text,
    router_config,
    running_router,
    wait_for_workers,
)
from tests.waiting import wait_for

MODEL = "cold"
_commands: Codec[OrchestratorCommand] = Codec(OrchestratorCommand)


class FakeOrchestrator:
    """Answers wakes on `orchestrator.wake`: starts a worker of the model once `gate` is set
    (`start` may give the answer itself: an `ok` naming the workers), or refuses with `refusal`."""

    def __init__(self, bus: Bus, bus_config: BusConfig, start: Callable[[], Awaitable[SimWorker | CommandOutcome]],
                 refusal: str = "") -> None:
        self.bus, self.subject, self.start, self.refusal = bus, bus_config.subjects.orchestrator_wake, start, refusal
        self.wakes: list[WakeModel] = []
        self.gate = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._subscription = None

    async def __aenter__(self) -> FakeOrchestrator:
        self._subscription = await self.bus.client.subscribe(self.subject, cb=self._on_wake)
        await self.bus.client.flush()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self._subscription.unsubscribe()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _on_wake(self, msg: Msg) -> None:
        command = _commands.decode(msg.data)
        assert isinstance(command, WakeModel)
        self.wakes.append(command)
        task = asyncio.create_task(self._answer(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, msg: Msg) -> None:
        if self.refusal:
            outcome = CommandOutcome(outcome="refused", reason=self.refusal)
        else:
            await self.gate.wait()
            started = await self.start()
            outcome = started if isinstance(started, CommandOutcome) else \
                CommandOutcome(outcome="ok", worker_id=started.worker_id, reason="started and registered")
        await self.bus.client.publish(msg.reply, encode(outcome))


@pytest.fixture
async def cold_router(bus_config: BusConfig, model_dir: str) -> AsyncIterator[Router]:
    scale = ScaleFromZeroConfig(models=(f"{MODEL}={model_dir}",), hold_s=20.0, max_held=3)
    async with running_router(router_config(bus_config, model_dir, scale_from_zero=scale)) as router:
        yield router


def held(text: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith("tandem_router_held_requests "))
    return float(line.split()[1])


async def complete(http: httpx.AsyncClient, seed: int) -> httpx.Response:
    prompt = [3 + (seed * 31 + i * 7) % 500 for i in range(20)]
    return await http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                                    "ignore_eos": True})


async def test_held_requests_are_answered_once_the_woken_worker_registers_and_the_queue_is_bounded(
        cold_router: Router, bus: Bus, bus_config: BusConfig, start_worker) -> None:
    router = cold_router
    models = [card["id"] for card in (await router.http.get("/v1/models")).json()["data"]]
    assert MODEL in models, models
    async with FakeOrchestrator(bus, bus_config, lambda: start_worker("cold-1", served_model_name=MODEL)) as fake:
        requests = [asyncio.create_task(complete(router.http, seed)) for seed in range(3)]

        async def three_held() -> bool:
            return held(await metrics_text(router)) == 3

        await wait_for(three_held, DEADLINE_S, "three requests held")
        started = time.monotonic()
        over = await complete(router.http, 9)
        assert over.status_code == 503 and int(over.headers["Retry-After"]) >= 1, over.text
        assert "already wait for a worker" in over.json()["error"]["message"]
        assert time.monotonic() - started < DEADLINE_S  # refused at once, not held
        assert [wake.model for wake in fake.wakes] == [MODEL]  # one ask for every held request

        fake.gate.set()
        answers = await asyncio.wait_for(asyncio.gather(*requests), DEADLINE_S * 2)
        assert all(answer.status_code == 200 for answer in answers), [answer.text for answer in answers]
        assert all(answer.json()["usage"]["completion_tokens"] == 4 for answer in answers)
        assert held(await metrics_text(router)) == 0
        assert len(fake.wakes) == 1


async def test_a_request_refused_by_a_worker_beginning_its_idle_drain_is_held_again(
        cold_router: Router, bus: Bus, bus_config: BusConfig, start_worker) -> None:
    draining = await start_worker("cold-draining", served_model_name=MODEL, refuse=True)
    await wait_for_workers(cold_router, 1)
    async with FakeOrchestrator(bus, bus_config, lambda: start_worker("cold-2", served_model_name=MODEL)) as fake:
        fake.gate.set()
        answer = await asyncio.wait_for(complete(cold_router.http, 5), DEADLINE_S * 2)
    assert answer.status_code == 200, answer.text
    assert len(draining.requests) == 1 and [wake.model for wake in fake.wakes] == [MODEL]


async def test_the_orchestrators_refusal_ends_the_hold_at_once(cold_router: Router, bus: Bus, bus_config: BusConfig,
                                                              start_worker) -> None:
    async with FakeOrchestrator(bus, bus_config, lambda: start_worker("never"), refusal="no worker launcher"):
        started = time.monotonic()
        answer = await complete(cold_router.http, 1)
    assert answer.status_code == 503 and int(answer.headers["Retry-After"]) >= 1, answer.text
    assert "no worker launcher" in answer.json()["error"]["message"]
    assert time.monotonic() - started < DEADLINE_S  # well before the 20 s hold


async def test_with_no_orchestrator_the_hold_ends_at_its_deadline(bus_config: BusConfig, model_dir: str) -> None:
    scale = ScaleFromZeroConfig(models=(f"{MODEL}={model_dir}",), hold_s=1.0)
    async with running_router(router_config(bus_config, model_dir, scale_from_zero=scale)) as router:
        started = time.monotonic()
        answer = await complete(router.http, 2)
        waited = time.monotonic() - started
    assert answer.status_code == 503 and int(answer.headers["Retry-After"]) >= 1, answer.text
    assert "started within 1s" in answer.json()["error"]["message"]
    assert 1.0 <= waited < DEADLINE_S


def route_decisions(text: str, flow: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tandem_router_route_decisions_total{") and f'flow="{flow}"' in line)


async def three_held_then_served_disaggregated(router: Router, fake: FakeOrchestrator) -> None:
    """Three requests of the P/D model are held; once `fake` answers the wake, each is served,
    disaggregated."""
    requests = [asyncio.create_task(complete(router.http, seed)) for seed in range(3)]

    async def three_held() -> bool:
        return held(await metrics_text(router)) == 3

    await wait_for(three_held, DEADLINE_S, "three requests held")
    fake.gate.set()
    answers = await asyncio.wait_for(asyncio.gather(*requests), DEADLINE_S * 2)
    assert all(answer.status_code == 200 for answer in answers), [answer.text for answer in answers]
    text = await metrics_text(router)
    assert (route_decisions(text, "disaggregated"), route_decisions(text, "single")) == (3, 0), text


async def test_a_pd_models_held_requests_wait_for_its_prefill_worker_when_the_decode_one_comes_first(
        bus: Bus, bus_config: BusConfig, model_dir: str, start_worker) -> None:
    scale = ScaleFromZeroConfig(models=(f"{MODEL}={model_dir}@1p1d",), hold_s=20.0)
    config = router_config(bus_config, model_dir, scale_from_zero=scale, routing=RoutingConfig(kv_aware=ALWAYS_SPLIT))
    async with running_router(config) as router:

        async def decode_first() -> SimWorker:
            decode = await start_worker("cold-decode", role=WorkerRole.DECODE, served_model_name=MODEL)
            await wait_for_workers(router, 1)  # without the wait for prefill, the held requests go whole to it now
            await start_worker("cold-prefill", role=WorkerRole.PREFILL, served_model_name=MODEL)
            await wait_for_workers(router, 2)
            return decode

        async with FakeOrchestrator(bus, bus_config, decode_first) as fake:
            await three_held_then_served_disaggregated(router, fake)


async def test_a_pd_models_held_requests_wait_for_the_prefill_worker_the_answer_names_when_it_shows_up_late(
        bus: Bus, bus_config: BusConfig, model_dir: str, start_worker) -> None:
    # The orchestrator answers once both workers are ACTIVE in its view of the members bucket;
    # this router's watch of it may deliver the prefill worker later (seen on a loaded CI host:
    # the answer came first and the held requests went whole to the decode worker).
    scale = ScaleFromZeroConfig(models=(f"{MODEL}={model_dir}@1p1d",), hold_s=20.0)
    config = router_config(bus_config, model_dir, scale_from_zero=scale, routing=RoutingConfig(kv_aware=ALWAYS_SPLIT))
    async with running_router(config) as router:
        late: list[asyncio.Task[SimWorker]] = []

        async def prefill_after_the_answer() -> SimWorker:
            await asyncio.sleep(0.5)
            return await start_worker("cold-prefill", role=WorkerRole.PREFILL, served_model_name=MODEL)

        async def answer_before_the_prefill_worker_registers() -> CommandOutcome:
            decode = await start_worker("cold-decode", role=WorkerRole.DECODE, served_model_name=MODEL)
            await wait_for_workers(router, 1)
            registration = decode.service.registration()
            prefill = msgspec.structs.replace(registration, worker_id="cold-prefill", role=WorkerRole.PREFILL)
            late.append(asyncio.create_task(prefill_after_the_answer()))
            return CommandOutcome(outcome="ok", worker_id=decode.worker_id, reason="started and registered",
                                  workers=[WorkerSummary(registration=registration, launched=True),
                                           WorkerSummary(registration=prefill, launched=True)])

        async with FakeOrchestrator(bus, bus_config, answer_before_the_prefill_worker_registers) as fake:
            await three_held_then_served_disaggregated(router, fake)
            await asyncio.wait_for(asyncio.gather(*late), DEADLINE_S)


async def test_a_wake_whose_named_worker_never_shows_up_ends_view_wait_s_after_its_answer(
        bus: Bus, bus_config: BusConfig, model_dir: str, start_worker) -> None:
    scale = ScaleFromZeroConfig(models=(f"{MODEL}={model_dir}@1p1d",), hold_s=20.0, view_wait_s=0.5)
    config = router_config(bus_config, model_dir, scale_from_zero=scale, routing=RoutingConfig(kv_aware=ALWAYS_SPLIT))
    async with running_router(config) as router:

        async def answer_naming_a_prefill_worker_that_never_registers() -> CommandOutcome:
            decode = await start_worker("cold-decode", role=WorkerRole.DECODE, served_model_name=MODEL)
            await wait_for_workers(router, 1)
            registration = decode.service.registration()
            ghost = msgspec.structs.replace(registration, worker_id="cold-prefill", role=WorkerRole.PREFILL)
            return CommandOutcome(outcome="ok", worker_id=decode.worker_id, reason="started and registered",
                                  workers=[WorkerSummary(registration=registration), WorkerSummary(registration=ghost)])

        async with FakeOrchestrator(bus, bus_config, answer_naming_a_prefill_worker_that_never_registers) as fake:
            fake.gate.set()
            answer = await asyncio.wait_for(complete(router.http, 1), DEADLINE_S)  # not held for hold_s
        assert answer.status_code == 200, answer.text
        assert route_decisions(await metrics_text(router), "single") == 1


async def test_without_scale_from_zero_an_unserved_model_is_a_404(router: Router) -> None:
    answer = await router.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert answer.status_code == 404  # not served: no worker registers it and it is not listed
