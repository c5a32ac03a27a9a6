"""Shared pieces of the router's integration tests: the router under uvicorn on port 0,
and a scripted fake worker on the real request plane.

Each fake worker registers in the members bucket and answers on its request-plane
subject with `FrameSender`, replying with the tokens of a fixed text. No tests here;
the test modules import these fixtures.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from nats.aio.msg import Msg

from services.router.main import RouterServer
from shared.bus import Bus
from shared.codec import Codec, encode
from shared.config import BusConfig, RouterConfig
from shared.request_plane import FrameSender
from shared.schemas import (
    Cancel,
    ControlMessage,
    GenerateRequest,
    WorkerCapacity,
    WorkerRegistration,
    WorkerRole,
    WorkerStatus,
)
from shared.subjects import Subjects
from shared.tiny_model import generate_tiny_model
from shared.tokenizer import Tokenizer

REPLY = " The river runs — café 東京 🚀 and on."
MODEL_DIR_NAME = "tiny-router"
DEADLINE_S = 5.0

_requests: Codec[GenerateRequest] = Codec(GenerateRequest)
_control: Codec[ControlMessage] = Codec(ControlMessage)


# ---- fixtures ------------------------------------------------------------------------


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


@pytest.fixture
async def router(bus_config: BusConfig, model_dir: str) -> AsyncIterator[Router]:
    config = router_config(bus_config, model_dir)
    server = RouterServer(config)
    task = asyncio.create_task(server.serve())
    await asyncio.wait_for(server.listening.wait(), DEADLINE_S)
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=20)
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as http:
        yield Router(server.url, config, client, http)
    await client.close()
    server.should_exit = True
    await asyncio.wait_for(task, 10)


# ---- a scripted worker ---------------------------------------------------------------


@dataclass
class FakeWorker:
    """Answers generate requests with the tokens of `reply_ids`, one token per frame.

    `hold=True` sends the first token, then waits for `release` (or a Cancel).
    `fail` sends a `Failed` frame after `fail_after` tokens; `refuse` answers every request
    with `Failed(unavailable)` before accepting it (as a draining worker does);
    `listening=False` registers without serving (a worker that just died).
    """

    bus: Bus
    subjects: Subjects
    worker_id: str
    model: str
    reply_ids: list[int]
    max_model_len: int = 2048
    hold: bool = False
    fail: str | None = None
    fail_after: int = 0
    status: WorkerStatus = WorkerStatus.ACTIVE
    refuse: bool = False
    listening: bool = True
    started_at: float = field(default_factory=time.time)
    requests: list[GenerateRequest] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    got_request: asyncio.Event = field(default_factory=asyncio.Event)
    got_cancel: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _subs: list = field(default_factory=list)

    def registration(self, status: WorkerStatus | None = None) -> WorkerRegistration:
        return WorkerRegistration(
            worker_id=self.worker_id, role=WorkerRole.BOTH, model=self.model, engine="fake", block_size=16,
            compat_hash="fake", capacity=WorkerCapacity(kv_blocks=64, max_num_seqs=8, max_model_len=self.max_model_len),
            status=status or self.status, started_at=self.started_at, heartbeat_at=time.time())

    async def start(self) -> "FakeWorker":
        client = self.bus.client
        if self.listening:
            self._subs = [await client.subscribe(self.subjects.generate(self.worker_id), cb=self._on_generate),
                          await client.subscribe(self.subjects.control(self.worker_id), cb=self._on_control)]
            await client.flush()
        await self.put(self.registration())
        return self

    async def put(self, registration: WorkerRegistration) -> None:
        members = await self.bus.key_value(self.subjects.members_bucket)
        await members.put(self.worker_id, encode(registration))

    async def deregister(self) -> None:
        members = await self.bus.key_value(self.subjects.members_bucket)
        await members.delete(self.worker_id)

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        for sub in self._subs:
            await sub.unsubscribe()

    async def _on_generate(self, msg: Msg) -> None:
        request = _requests.decode(msg.data)
        self.requests.append(request)
        self.got_request.set()
        self._tasks[request.request_id] = asyncio.create_task(self._serve(request, FrameSender(self.bus, msg.reply)))

    async def _on_control(self, msg: Msg) -> None:
        message = _control.decode(msg.data)
        if isinstance(message, Cancel):
            self.cancels.append(message.request_id)
            self.got_cancel.set()
            task = self._tasks.get(message.request_id)
            if task is not None:
                task.cancel()

    async def _serve(self, request: GenerateRequest, sender: FrameSender) -> None:
        if self.refuse:
            await sender.failed("unavailable", f"worker {self.worker_id} is draining")
            return
        await sender.accepted(self.worker_id)
        budget = request.sampling.max_tokens
        tokens = self.reply_ids[:budget]
        for index, token in enumerate(tokens):
            if self.fail is not None and index == self.fail_after:
                await sender.failed(self.fail, f"scripted failure after {index} tokens")
                return
            if self.hold and index == 1:
                await self.release.wait()
            await sender.tokens([token])
        await sender.finished("length" if len(self.reply_ids) >= budget else "stop",
                              prompt_tokens=len(request.token_ids), cached_tokens=3,
                              completion_tokens=len(tokens))


@pytest.fixture
async def start_worker(bus: Bus, bus_config: BusConfig, tokenizer: Tokenizer
                       ) -> AsyncIterator[Callable[..., Awaitable[FakeWorker]]]:
    workers: list[FakeWorker] = []

    async def start(worker_id: str = "w1", **options) -> FakeWorker:
        options.setdefault("reply_ids", tokenizer.encode(REPLY))
        options.setdefault("model", MODEL_DIR_NAME)
        worker = FakeWorker(bus, bus_config.subjects, worker_id, **options)
        workers.append(worker)
        return await worker.start()

    yield start
    for worker in workers:
        worker.release.set()
        await worker.stop()


async def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def wait_for_workers(router: Router, count: int) -> None:
    async def worker_count() -> int:
        return (await router.http.get("/health")).json()["worker_count"]

    deadline = time.monotonic() + DEADLINE_S
    while await worker_count() != count:
        assert time.monotonic() < deadline, f"router never saw {count} workers"
        await asyncio.sleep(0.01)


def expected_text(tokenizer: Tokenizer, max_tokens: int) -> str:
    return tokenizer.decode(tokenizer.encode(REPLY)[:max_tokens])


async def wait_until_idle(router: Router) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while (await router.http.get("/health")).json()["in_flight"]:
        assert time.monotonic() < deadline, "requests still in flight"
        await asyncio.sleep(0.01)
