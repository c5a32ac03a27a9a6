"""Shared pieces of the router's integration tests: the router under uvicorn on port 0,
and a scripted fake worker on the real request plane.

Each fake worker registers in the members bucket and answers on its request-plane
subject with `FrameSender`, replying with the tokens of a fixed text. It plays the
prefill and decode parts of the disaggregated flow as the real worker does: a request
with `hold_for_decode` gets its prompt's full blocks leased (served on the worker's
lease subject, releases recorded), a request with a `source` handle "pulls" and releases
that lease on its holder. With `engine="sim"` it plays push mode too: a request with
`await_push` answers a `KvTarget` and waits for the writer's `PushDone` (its first token),
a request with `push_to` sends `PushDone` to the reader (failed when it fails first). No tests here; the test modules import these fixtures.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
import msgspec
import openai
import pytest
from nats.aio.msg import Msg

from services.router.main import RouterServer
from shared.bus import Bus
from shared.codec import Codec, encode
from shared.config import BusConfig, RouterConfig
from shared.request_plane import FrameSender
from shared.schemas import (
    BlockStored,
    Cancel,
    ControlMessage,
    EngineCapabilities,
    Finished,
    GenerateRequest,
    KvEventBatch,
    LoadSnapshot,
    PushDone,
    WorkerCapacity,
    WorkerRegistration,
    WorkerRole,
    WorkerStatus,
)
from shared.schemas.generate import FinishReason
from shared.schemas.transfer import KvHandle, LeaseAck, LeaseMessage, LeaseRelease, PushTarget
from shared.subjects import Subjects
from shared.tiny_model import generate_tiny_model
from shared.tokenizer import Tokenizer

REPLY = " The river runs — café 東京 🚀 and on."
MODEL_DIR_NAME = "tiny-router"
DEADLINE_S = 5.0

_requests: Codec[GenerateRequest] = Codec(GenerateRequest)
_control: Codec[ControlMessage] = Codec(ControlMessage)
_lease_messages: Codec[LeaseMessage] = Codec(LeaseMessage)
_lease_acks: Codec[LeaseAck] = Codec(LeaseAck)
BLOCK_SIZE = 16


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


# ---- a scripted worker ---------------------------------------------------------------


class _Sender(FrameSender):
    """A `FrameSender` whose `Finished` may carry the hand-off fields."""

    async def finished_with(self, finish_reason: FinishReason, **fields) -> None:
        await self._send(Finished(seq=self._seq, finish_reason=finish_reason, **fields))
        self.closed = True


@dataclass
class FakeWorker:
    """Answers generate requests with the tokens of `reply_ids`, one token per frame.

    `hold=True` sends the first token (`hold_at + 1` tokens), then waits for `release` (or a
    Cancel); `hold_accept=True` waits for `release` before accepting at all.
    `fail` sends a `Failed` frame after `fail_after` tokens; `refuse` answers every request
    with `Failed(unavailable)` before accepting it (as a draining worker does);
    `listening=False` registers without serving (a worker that just died).
    `continue_history=True` makes the output a function of the token history, as a real
    model's is: the token after a history of n tokens is `reply_ids[n % len(reply_ids)]`,
    so a prompt continued elsewhere (prefill here, decode there) reads the same.
    As a prefill worker it leases the prompt's full blocks when asked to hold them; as a
    decode worker it releases the lease it pulled from ("done"), after accepting.
    `store_blocks()` publishes KV events announcing that it caches a prompt's full blocks,
    `report_load()` a load snapshot.
    """

    bus: Bus
    subjects: Subjects
    worker_id: str
    model: str
    reply_ids: list[int]
    role: WorkerRole = WorkerRole.BOTH
    compat_hash: str = "fake"
    engine: str = "fake"  # "sim": the router may drive push mode with it
    max_model_len: int = 2048
    max_num_seqs: int = 8
    hold: bool = False
    hold_at: int = 0  # with `hold`: the index of the token after which it waits
    hold_accept: bool = False
    fail: str | None = None
    fail_after: int = 0
    status: WorkerStatus = WorkerStatus.ACTIVE
    refuse: bool = False
    listening: bool = True
    continue_history: bool = False
    recomputed_tokens: int = 0  # as a decode worker: tokens of the pulled blocks that "failed"
    started_at: float = field(default_factory=time.time)
    requests: list[GenerateRequest] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    leases: dict[str, KvHandle] = field(default_factory=dict)  # granted, still held
    lease_releases: list[LeaseRelease] = field(default_factory=list)
    got_request: asyncio.Event = field(default_factory=asyncio.Event)
    got_cancel: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _subs: list = field(default_factory=list)
    _lease_ids: int = 0
    _kv_seq: int = 0
    _load_seq: int = 0
    _pushes: dict[str, asyncio.Future[PushDone]] = field(default_factory=dict)  # by transfer id

    def registration(self, status: WorkerStatus | None = None) -> WorkerRegistration:
        return WorkerRegistration(
            worker_id=self.worker_id, role=self.role, model=self.model, engine=self.engine, block_size=BLOCK_SIZE,
            compat_hash=self.compat_hash, capabilities=EngineCapabilities(kv_push=self.engine == "sim"),
            capacity=WorkerCapacity(kv_blocks=64, max_num_seqs=self.max_num_seqs,
                                    max_model_len=self.max_model_len),
            status=status or self.status, started_at=self.started_at, heartbeat_at=time.time())

    async def start(self) -> "FakeWorker":
        client = self.bus.client
        if self.listening:
            self._subs = [await client.subscribe(self.subjects.generate(self.worker_id), cb=self._on_generate),
                          await client.subscribe(self.subjects.control(self.worker_id), cb=self._on_control),
                          await client.subscribe(self.subjects.kv_lease(self.worker_id), cb=self._on_lease)]
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

    async def store_blocks(self, token_ids: list[int]) -> None:
        """Announce (KV events) that this worker caches every full block of `token_ids`."""
        blocks = len(token_ids) // BLOCK_SIZE
        self._kv_seq += 1
        engine_hashes = [self._kv_seq * 1_000_000 + index for index in range(blocks)]
        batch = KvEventBatch(worker_id=self.worker_id, seq=self._kv_seq, ts=time.time(), events=[
            BlockStored(block_hashes=engine_hashes, parent_block_hash=None,
                        token_ids=token_ids[:blocks * BLOCK_SIZE], block_size=BLOCK_SIZE)])
        await self.bus.client.publish(self.subjects.kv_events(self.worker_id), encode(batch))
        await self.bus.client.flush()

    async def report_load(self, running: int, waiting: int = 0, pending_prefill_tokens: int = 0) -> None:
        self._load_seq += 1
        snapshot = LoadSnapshot(worker_id=self.worker_id, seq=self._load_seq, ts=time.time(), running=running,
                                waiting=waiting, kv_total_blocks=64, kv_used_blocks=0, kv_cached_blocks=0,
                                prompt_tokens_total=0, cached_tokens_total=0, generated_tokens_total=0,
                                pending_prefill_tokens=pending_prefill_tokens)
        await self.bus.client.publish(self.subjects.load(self.worker_id), encode(snapshot))
        await self.bus.client.flush()

    def released(self, lease_id: str) -> list[str]:
        """The outcomes of every release of `lease_id` received so far."""
        return [release.outcome for release in self.lease_releases if release.lease_id == lease_id]

    async def _on_generate(self, msg: Msg) -> None:
        request = _requests.decode(msg.data)
        self.requests.append(request)
        self.headers.append(dict(msg.headers or {}))
        self.got_request.set()
        self._tasks[request.request_id] = asyncio.create_task(self._serve(request, _Sender(self.bus, msg.reply)))

    async def _on_control(self, msg: Msg) -> None:
        message = _control.decode(msg.data)
        if isinstance(message, Cancel):
            self.cancels.append(message.request_id)
            self.got_cancel.set()
            task = self._tasks.get(message.request_id)
            if task is not None:
                task.cancel()
        elif isinstance(message, PushDone):
            push = self._pushes.pop(message.transfer_id, None)
            if push is not None and not push.done():
                push.set_result(message)

    async def _on_lease(self, msg: Msg) -> None:
        message = _lease_messages.decode(msg.data)
        assert isinstance(message, LeaseRelease), message
        self.lease_releases.append(message)
        held = self.leases.pop(message.lease_id, None)
        await self.bus.client.publish(msg.reply, encode(LeaseAck(lease_id=message.lease_id, ok=held is not None)))

    def _lease_prompt(self, request: GenerateRequest) -> KvHandle | None:
        blocks = len(request.token_ids) // BLOCK_SIZE
        if not blocks:
            return None
        self._lease_ids += 1
        handle = KvHandle(holder_worker_id=self.worker_id, agent_name=f"agent-{self.worker_id}",
                          lease_id=f"{self.worker_id}-lease-{self._lease_ids}", compat_hash=self.compat_hash,
                          block_size=BLOCK_SIZE, block_ids=list(range(blocks)), block_hashes=list(range(blocks)),
                          checksums=[0] * blocks, ttl_s=10.0)
        self.leases[handle.lease_id] = handle
        return handle

    async def _pull(self, handle: KvHandle) -> None:
        reply = await self.bus.client.request(self.subjects.kv_lease(handle.holder_worker_id),
                                              encode(LeaseRelease(lease_id=handle.lease_id, outcome="done")),
                                              timeout=DEADLINE_S)
        _lease_acks.decode(reply.data)

    def _reply(self, request: GenerateRequest) -> list[int]:
        budget = request.sampling.max_tokens
        if not self.continue_history:
            return self.reply_ids[:budget]
        tokens = []
        for index in range(budget):
            token = self.reply_ids[(len(request.token_ids) + index) % len(self.reply_ids)]
            tokens.append(token)
            if token in request.sampling.stop_token_ids:
                break
        return tokens

    async def _await_push(self, request: GenerateRequest, sender: _Sender) -> GenerateRequest | None:
        """As a push reader: the request continued after the pushed first token; None if the push failed."""
        blocks = len(request.token_ids) // BLOCK_SIZE
        target = PushTarget(reader_worker_id=self.worker_id, agent_name=f"agent-{self.worker_id}",
                            transfer_id=f"{self.worker_id}-push-{request.request_id}", compat_hash=self.compat_hash,
                            block_ids=list(range(blocks)))
        done = self._pushes[target.transfer_id] = asyncio.get_running_loop().create_future()
        await sender.kv_target(target)
        message = await asyncio.wait_for(done, DEADLINE_S)
        if message.first_token is None:
            await sender.failed("unavailable", f"the prefill worker failed: {message.outcome}")
            return None
        return msgspec.structs.replace(request, token_ids=[*request.token_ids, message.first_token])

    async def _push_done(self, target: PushTarget, first_token: int | None) -> None:
        done = PushDone(transfer_id=target.transfer_id, outcome="failed" if first_token is None else "done",
                        checksums=[], first_token=first_token)
        await self.bus.client.publish(self.subjects.control(target.reader_worker_id), encode(done))

    async def _serve(self, request: GenerateRequest, sender: _Sender) -> None:
        push_to = request.kv_transfer.push_to if request.kv_transfer is not None else None
        try:
            await self._generate(request, sender)
        finally:
            if push_to is not None and not sender.closed:  # failed or cancelled: the reader must not wait
                await self._push_done(push_to, None)

    async def _generate(self, request: GenerateRequest, sender: _Sender) -> None:
        if self.refuse:
            await sender.failed("unavailable", f"worker {self.worker_id} is draining")
            return
        if self.hold_accept:
            await self.release.wait()
        await sender.accepted(self.worker_id)
        transfer = request.kv_transfer
        source = transfer.source if transfer is not None else None
        if source is not None:
            await self._pull(source)
        if transfer is not None and transfer.await_push:
            continued = await self._await_push(request, sender)
            if continued is None:
                return
            request = continued
        budget = request.sampling.max_tokens
        tokens = self._reply(request)
        for index, token in enumerate(tokens):
            if self.fail is not None and index == self.fail_after:
                await sender.failed(self.fail, f"scripted failure after {index} tokens")
                return
            if transfer is not None and transfer.push_to is not None and index == 0:
                await self._push_done(transfer.push_to, token)
            await sender.tokens([token])
            if self.hold and index == self.hold_at:
                await self.release.wait()
        if self.continue_history:
            reason: FinishReason = "length" if len(tokens) == budget and tokens[-1] not in \
                request.sampling.stop_token_ids else "stop"
        else:
            reason = "length" if len(self.reply_ids) >= budget else "stop"
        handle = self._lease_prompt(request) if transfer is not None and transfer.hold_for_decode else None
        pulled = 0 if source is None else source.num_tokens - self.recomputed_tokens
        await sender.finished_with(reason, prompt_tokens=len(request.token_ids), cached_tokens=3,
                                   completion_tokens=len(tokens), kv_handle=handle, pulled_tokens=pulled,
                                   recomputed_tokens=0 if source is None else self.recomputed_tokens)


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
