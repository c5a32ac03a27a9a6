"""End-to-end fixtures: the whole stack as separate processes, from the same definition
`tandem up` uses, driven by the official `openai` client.

One stack per module (a stack start costs seconds); each test checks afterwards that
every worker's KV pool is back to its baseline, and teardown checks no process is left.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import openai
import pytest

from launch.plan import StackConfig, WorkerSpec
from launch.stack import LocalStack
from shared.bus import Bus, connect
from shared.codec import Codec
from shared.nats_server import EmbeddedNats, pid_alive
from shared.schemas import LoadSnapshot
from shared.subjects import Subjects
from shared.tiny_model import generate_tiny_model

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("models") / "tiny"
    generate_tiny_model(str(path))
    return str(path)


def make_stack(nats_server: EmbeddedNats, model_dir: str, log_dir: Path, workers: int = 2,
               specs: tuple[WorkerSpec, ...] = (), router_args: tuple[str, ...] = ()) -> LocalStack:
    config = StackConfig(
        model_dir=model_dir,
        workers=(*(WorkerSpec(worker_id=f"w{i + 1}") for i in range(workers)), *specs),
        router_port=0,
        metrics_port=0,
        nats_url=nats_server.url,
        namespace="e2e" + uuid.uuid4().hex[:10],
        heartbeat_interval_s=0.2,
        ttl_s=1.5,
        log_dir=str(log_dir),
        router_args=router_args,
    )
    return LocalStack(config)


@pytest.fixture(scope="module")
def stack(nats_server: EmbeddedNats, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    local = make_stack(nats_server, tiny_model_dir, tmp_path_factory.mktemp("stack-logs"))
    local.start()
    pids = [process.pid for process in local.processes.values()]
    yield local
    extra = [process.pid for process in local.processes.values()]
    local.stop()
    alive = [pid for pid in set(pids + extra) if pid_alive(pid)]
    assert not alive, f"processes left behind: {alive}"


@pytest.fixture
def client(stack: LocalStack, openai_client) -> openai.AsyncOpenAI:
    return openai_client(stack.router_url)


@pytest.fixture
async def stack_bus(stack: LocalStack) -> AsyncIterator[Bus]:
    bus = await connect(stack.nats_url, "e2e-test")
    yield bus
    await bus.close()


class LoadWatcher:
    """The latest load snapshot of every worker, read straight off the bus."""

    def __init__(self) -> None:
        self.latest: dict[str, LoadSnapshot] = {}
        self._codec: Codec[LoadSnapshot] = Codec(LoadSnapshot)

    async def start(self, bus: Bus, subject: str) -> None:
        async def on_load(msg) -> None:
            snapshot = self._codec.decode_or_none(msg.data, msg.subject)
            if snapshot is not None:
                self.latest[snapshot.worker_id] = snapshot

        await bus.client.subscribe(subject, cb=on_load)

    async def wait_idle(self, worker_ids: list[str], timeout_s: float = 10.0) -> None:
        """Every listed worker reports no running or waiting request and no used KV block."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            snaps = [self.latest.get(w) for w in worker_ids]
            if all(s is not None and s.running == 0 and s.waiting == 0 and s.kv_used_blocks == 0 for s in snaps):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"KV pools not back to baseline: {self.latest}")


@pytest.fixture
async def loads(stack: LocalStack, stack_bus: Bus) -> AsyncIterator[LoadWatcher]:
    watcher = LoadWatcher()
    await watcher.start(stack_bus, Subjects(stack.config.namespace).load_all)
    yield watcher
    live = [name for name, process in stack.processes.items()
            if process.alive and name not in ("router", "metrics", "orchestrator")]
    await watcher.wait_idle(live)
