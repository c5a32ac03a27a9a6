"""Shared fixtures of the router's integration tests: the real router (`RouterServer` under
uvicorn on port 0) and real workers on the session's nats-server.

A worker here is what `tandem worker` runs, in the test's process and event loop: the sim
engine and its KV data plane built through the engine registry and the worker's own wiring
(`services.worker.main.build_kv`), served by `WorkerService` on a NATS connection of its
own. KV moves over the in-memory transport: these tests need no NIXL. Where a test needs a
behaviour no real worker shows on cue (silence at a chosen token, an engine failure, a
dead or refusing member), `router_fakes` supplies the smallest stand-in.

A `Recorder` on the test's own connection sees what the router sends each worker
(generate requests with their headers, cancels, lease releases), so tests assert on the
router's side of the protocol. After each test every worker still running must be idle:
nothing in flight, no lease held, no KV block in use (pinned or allocated).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
import msgspec
import openai
import pytest
from nats.aio.msg import Msg

from services.router.config import RouterConfig
from services.router.main import RouterServer
from services.worker.engines import engine_spec
from services.worker.main import build_kv
from services.worker.service import WorkerService
from services.worker.sim.config import SimEngineConfig
from services.worker.sim.tokens import generate_tokens
from shared.bus import Bus, connect
from shared.codec import Codec
from shared.config import BusConfig, KvFaultConfig, KvTransferConfig, MembershipConfig, WorkerConfig
from shared.request_plane import open_stream
from shared.schemas import Cancel, ControlMessage, GenerateRequest, SamplingParams, WorkerRole
from shared.schemas.membership import EngineCapabilities
from shared.schemas.transfer import LeaseMessage, LeaseRelease
from shared.tiny_model import generate_tiny_model
from shared.tokenizer import Tokenizer
from tests.integration.router_fakes import GatedSimEngine, ScriptedMember
from tests.waiting import wait_for

MODEL_DIR_NAME = "tiny-router"
DEADLINE_S = 5.0
BLOCK_SIZE = 16

_requests: Codec[GenerateRequest] = Codec(GenerateRequest)
_control: Codec[ControlMessage] = Codec(ControlMessage)
_lease_messages: Codec[LeaseMessage] = Codec(LeaseMessage)


# ---- the router ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("router-model") / MODEL_DIR_NAME
    generate_tiny_model(str(path))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(model_dir: str) -> Tokenizer:
    return Tokenizer.from_model_dir(model_dir)


@dataclass
class Router:
    url: str
    config: RouterConfig
    client: openai.AsyncOpenAI
    http: httpx.AsyncClient


def router_config(bus_config: BusConfig, model_dir: str, **overrides) -> RouterConfig:
    settings = dict(host="127.0.0.1", port=0, model_dir=model_dir, bus=bus_config, max_tokens_limit=256,
                    worker_wait_s=0.5, accept_timeout_s=2.0, idle_timeout_s=30.0)
    settings.update(overrides)
    return RouterConfig(**settings)


@asynccontextmanager
async def running_router(config: RouterConfig) -> AsyncIterator[Router]:
    server = RouterServer(config)
    task = asyncio.create_task(server.serve())
    await asyncio.wait_for(server.listening.wait(), DEADLINE_S)
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=20)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as http:
            yield Router(server.url, config, client, http)
    finally:
        await client.close()
        server.should_exit = True
        await asyncio.wait_for(task, 10)


@pytest.fixture
async def router(bus_config: BusConfig, model_dir: str) -> AsyncIterator[Router]:
    async with running_router(router_config(bus_config, model_dir)) as running:
        yield running


async def metrics_text(router: Router) -> str:
    return (await router.http.get("/metrics")).text


async def wait_for_metric(router: Router, line: str) -> None:
    async def present() -> bool:
        return line in await metrics_text(router)

    await wait_for(present, DEADLINE_S, f"{line!r} in the router's metrics")


async def wait_for_workers(router: Router, count: int) -> None:
    async def seen() -> bool:
        return (await router.http.get("/health")).json()["worker_count"] == count

    await wait_for(seen, DEADLINE_S, f"the router to see {count} workers")


async def wait_until_idle(router: Router) -> None:
    async def idle() -> bool:
        return not (await router.http.get("/health")).json()["in_flight"]

    await wait_for(idle, DEADLINE_S, "no request in flight in the router")


# ---- workers -------------------------------------------------------------------------


@dataclass
class Recorder:
    """What the router sent one worker, seen from the test's own connection."""

    bus: Bus
    worker_id: str
    requests: list[GenerateRequest] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    lease_releases: list[LeaseRelease] = field(default_factory=list)
    _subscriptions: list = field(default_factory=list)

    async def start(self, subjects, *, generate: bool) -> None:
        # A subscriber on the generate subject of a member nobody serves would turn the
        # router's instant "no responders" into an accept timeout: those are not tapped.
        client = self.bus.client
        taps = [(subjects.control_all(self.worker_id), self._on_control),
                (subjects.kv_lease(self.worker_id), self._on_lease),
                (subjects.kv_release(self.worker_id), self._on_lease)]
        if generate:
            taps.append((subjects.generate(self.worker_id), self._on_generate))
        self._subscriptions = [await client.subscribe(subject, cb=callback) for subject, callback in taps]
        await client.flush()

    async def stop(self) -> None:
        for subscription in self._subscriptions:
            await subscription.unsubscribe()

    async def _on_generate(self, msg: Msg) -> None:
        self.requests.append(_requests.decode(msg.data))
        self.headers.append(dict(msg.headers or {}))

    async def _on_control(self, msg: Msg) -> None:
        message = _control.decode(msg.data)
        if isinstance(message, Cancel):
            self.cancels.append(message.request_id)

    async def _on_lease(self, msg: Msg) -> None:
        message = _lease_messages.decode(msg.data)
        if isinstance(message, LeaseRelease):
            self.lease_releases.append(message)


@dataclass
class SimWorker:
    """One worker of the test cluster: a real `WorkerService` (`service`), or a scripted
    member (`member`) where the test needs one; `recorder` holds what the router sent it."""

    worker_id: str
    recorder: Recorder
    test_bus: Bus
    bus_config: BusConfig
    service: WorkerService | None = None
    member: ScriptedMember | None = None
    bus: Bus | None = None  # the worker's own connection
    running: bool = True  # False once stopped or lost

    @property
    def requests(self) -> list[GenerateRequest]:
        return self.recorder.requests

    @property
    def headers(self) -> list[dict[str, str]]:
        return self.recorder.headers

    @property
    def cancels(self) -> list[str]:
        return self.recorder.cancels

    def released(self, lease_id: str | None = None) -> list[str]:
        """The outcomes of the lease releases received so far (of `lease_id`, or all)."""
        return [release.outcome for release in self.recorder.lease_releases
                if lease_id is None or release.lease_id == lease_id]

    @property
    def engine(self):
        assert self.service is not None, f"{self.worker_id} is a scripted member"
        return self.service.engine

    @property
    def active_leases(self) -> int:
        return self.service.kv.active_leases

    def release(self) -> None:
        """Let a held request go on (see `GatedSimEngine`)."""
        if self.service is not None and isinstance(self.engine, GatedSimEngine):
            self.engine.release.set()

    def idle(self) -> bool:
        service = self.service
        return (service.inflight == 0 and (service.kv is None or service.kv.active_leases == 0)
                and service.engine.load().kv_used_blocks == 0)

    def state(self) -> str:
        service = self.service
        return (f"{self.worker_id}: {service.inflight} in flight, "
                f"{service.kv.active_leases if service.kv else 0} leases, "
                f"{service.engine.load().kv_used_blocks} blocks in use")

    async def warm(self, token_ids: list[int]) -> None:
        """Compute `token_ids` on this worker directly (as another router's request would), so
        it caches their full blocks and announces them in KV events; not recorded."""
        count = len(self.requests)
        request = GenerateRequest(request_id=f"warm-{self.worker_id}-{count}", model=self.engine.info.model,
                                  token_ids=token_ids, sampling=SamplingParams(max_tokens=1, temperature=0.0))
        stream = await open_stream(self.test_bus, self.bus_config.subjects.generate(self.worker_id), request)
        try:
            [_ async for _ in stream.frames()]
        finally:
            await stream.close()
        await wait_for(lambda: len(self.requests) == count + 1, DEADLINE_S, "the recorder to see the warm-up")
        del self.requests[count:], self.headers[count:]

    async def stop(self) -> None:
        """A graceful stop: drain, deregister, stop the engine."""
        self.running = False
        if self.service is not None and not self.service.stopped.is_set():
            await self.service.stop()
        if self.member is not None:
            await self.member.stop()

    async def lose(self) -> None:
        """The worker is lost: its entry goes (as the TTL removes a worker that stopped
        heartbeating) and a request it holds hears nothing more. Its connection stays open,
        so that it can be stopped cleanly after the test; a lost worker is never checked
        for leaks."""
        self.running = False
        members = await self.test_bus.key_value(self.bus_config.subjects.members_bucket)
        await members.delete(self.worker_id)

    async def shutdown(self) -> None:
        self.release()
        if self.service is not None and not self.service.stopped.is_set():
            await self.service.stop()
        if self.member is not None and self.running:
            await self.member.stop()
        if self.bus is not None:
            await self.bus.close()
        await self.recorder.stop()


SIM = SimEngineConfig(speedup=50.0)  # the workers' sim


def worker_config(worker_id: str, bus_config: BusConfig, model_dir: str, *, role: WorkerRole = WorkerRole.BOTH,
                  kv_faults: KvFaultConfig | None = None, **overrides) -> WorkerConfig:
    settings = dict(worker_id=worker_id, role=role, engine="sim", model_dir=model_dir, bus=bus_config,
                    kv_blocks=512, block_size=BLOCK_SIZE, drain_timeout_s=2.0,
                    # one registration at start: a worker's entry changes only when a test says so
                    membership=MembershipConfig(heartbeat_interval_s=30.0, ttl_s=90.0),
                    load_interval_s=0.05, kv_event_interval_s=0.01,
                    kv_transfer=KvTransferConfig(transport="memory", faults=kv_faults or KvFaultConfig()))
    settings.update(overrides)
    config = WorkerConfig(**settings)
    config.validate()
    return config


async def launch_worker(config: WorkerConfig, test_bus: Bus, tokenizer: Tokenizer, *, hold: bool = False,
                        hold_at: int = 0, stall: bool = False, fail: str | None = None, fail_after: int = 0,
                        refuse: bool = False, silent: bool = False, listening: bool = True, draining: bool = False,
                        capabilities: EngineCapabilities | None = None, sim: SimEngineConfig = SIM) -> SimWorker:
    """Start one worker of `config`, its sim's options `sim` (other options: see
    `start_worker`); `test_bus` records for it."""
    spec = engine_spec(config.engine)
    capabilities = capabilities or spec.capabilities
    answer = "refuse" if refuse else "silent" if silent else None
    recorder = Recorder(test_bus, config.worker_id)
    await recorder.start(config.bus.subjects, generate=listening)
    worker = SimWorker(config.worker_id, recorder, test_bus, config.bus)
    if answer is not None or not listening:
        engine = spec.build_engine(config, sim)  # never started: only its registration is used
        registration = WorkerService(config, engine, test_bus, None, capabilities=capabilities).registration()
        registration = msgspec.structs.replace(registration, kv_transfer=True)
        worker.member = await ScriptedMember(test_bus, config.bus.subjects, registration, answer).start()
        return worker
    if hold or stall or fail is not None:
        model = config.served_model_name or tokenizer.model_name
        engine = GatedSimEngine(config, sim, model_name=model, vocab_size=tokenizer.vocab_size,
                                hold_at=-1 if stall else hold_at if hold else None,
                                fail=None if fail is None else (fail, fail_after))
    else:
        engine = spec.build_engine(config, sim)
    worker.bus = await connect(config.bus.nats_url, f"worker-{config.worker_id}")
    await engine.start()
    worker.service = WorkerService(config, engine, worker.bus, build_kv(config, spec, engine, worker.bus),
                                   capabilities=capabilities)
    await worker.service.start()
    if draining:
        await worker.service.drain()
    return worker


async def check_idle(workers: list[SimWorker]) -> None:
    """Every real worker still running: nothing in flight, no lease, no KV block in use."""
    for worker in workers:
        worker.release()
    for worker in workers:
        if worker.running and worker.service is not None:
            await wait_for(worker.idle, DEADLINE_S, f"an idle worker ({worker.state()})")


@pytest.fixture
async def start_worker(bus: Bus, bus_config: BusConfig, model_dir: str, tokenizer: Tokenizer
                       ) -> AsyncIterator[Callable[..., Awaitable[SimWorker]]]:
    """Start a worker on the session's nats-server; options:

    - `role`, `kv_faults` and any `WorkerConfig` field (`served_model_name`, `model_version`,
      `max_model_len`, `max_num_seqs`, ...);
    - `capabilities`: advertise these instead of the sim engine's (e.g. a pull-only engine's);
    - `hold=True` (with `hold_at`): the engine's stream waits after that token until
      `release()`; `stall=True`: accepts, then waits before any token;
      `fail=code` (with `fail_after`): the engine fails the request before that token;
    - `draining=True`: started, then draining (registered, refusing new work);
    - `refuse=True`: a member refusing every request; `silent=True`: a hung member that
      never answers; `listening=False`: a dead member (see `router_fakes.ScriptedMember`).
    After the test, every worker still running must be idle (`check_idle`).
    """
    workers: list[SimWorker] = []

    async def start(worker_id: str = "w1", *, role: WorkerRole = WorkerRole.BOTH,
                    kv_faults: KvFaultConfig | None = None, hold: bool = False, hold_at: int = 0,
                    stall: bool = False, fail: str | None = None, fail_after: int = 0, refuse: bool = False,
                    silent: bool = False, listening: bool = True, draining: bool = False,
                    capabilities: EngineCapabilities | None = None, **config_fields) -> SimWorker:
        config = worker_config(worker_id, bus_config, model_dir, role=role, kv_faults=kv_faults, **config_fields)
        worker = await launch_worker(config, bus, tokenizer, hold=hold, hold_at=hold_at, stall=stall, fail=fail,
                                     fail_after=fail_after, refuse=refuse, silent=silent, listening=listening,
                                     draining=draining, capabilities=capabilities)
        workers.append(worker)
        return worker

    yield start
    try:
        await check_idle(workers)
    finally:
        for worker in workers:
            await worker.shutdown()


def reference_tokens(request: GenerateRequest, vocab_size: int) -> list[int]:
    """What the sim engine answers `request` with, wherever it runs."""
    return generate_tokens(request.token_ids, request.sampling, vocab_size)[0]


@pytest.fixture
async def start_pd(start_worker: Callable[..., Awaitable[SimWorker]]
                   ) -> Callable[..., Awaitable[tuple[SimWorker, SimWorker]]]:
    """Start a prefill and a decode worker (ids "p1", "d1" unless given), each with its own
    `start_worker` options."""

    async def start(prefill: dict | None = None, decode: dict | None = None) -> tuple[SimWorker, SimWorker]:
        prefill = {"worker_id": "p1", **(prefill or {})}
        decode = {"worker_id": "d1", **(decode or {})}
        prefill_worker = await start_worker(prefill.pop("worker_id"), role=WorkerRole.PREFILL, **prefill)
        decode_worker = await start_worker(decode.pop("worker_id"), role=WorkerRole.DECODE, **decode)
        return prefill_worker, decode_worker

    return start
