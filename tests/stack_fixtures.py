"""What the whole-stack tests share, sim (tests/e2e) and vLLM (tests/vllm) alike.

Registered as a pytest plugin by tests/conftest.py, so the `tiny_model_dir` fixture is
everywhere; the rest is imported:
- `make_stack` defines a local stack (the definition `tandem up` uses) on the session's
  nats-server with a fresh namespace and short heartbeats; `running` starts it and, at
  the end, stops it and checks that no process it started (nor any process of their
  groups: an engine's own processes) is left.
- `LoadWatcher` keeps each worker's latest load report, read straight off the bus:
  `wait_idle` (no request, no used KV block) and `fresh_reports` (reports taken after
  now, so the cumulative counters they carry include everything done before).
- `StackObserver` / `observing`: load reports and KV transfer records of one stack.
- `collect` subscribes a list to a subject's records; `records_arrived` waits for them;
  `request_records`: the request records of one stack.
- `group_members` / `group_cpu_seconds`: processes and CPU time of a process group.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest

from launch.load_reports import LatestLoads
from launch.plan import StackConfig, WorkerSpec
from launch.stack import LocalStack
from shared.bus import Bus, connect
from shared.codec import Codec
from shared.nats_server import EmbeddedNats
from shared.schemas import RequestRecord, TransferRecord
from shared.subjects import Subjects
from shared.tiny_model import generate_tiny_model
from shared.vision_model import generate_vision_model
from tests.waiting import wait_for


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("models") / "tiny"
    generate_tiny_model(str(path))
    return str(path)


@pytest.fixture(scope="session")
def vision_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The generated vision-language model (`shared.vision_model`, an Idefics3)."""
    path = tmp_path_factory.mktemp("models") / "vision"
    generate_vision_model(str(path))
    return str(path)


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A second tiny model with another vocabulary (1024 tokens): several models behind one router."""
    path = tmp_path_factory.mktemp("models") / "small"
    generate_tiny_model(str(path), vocab_size=1024)
    return str(path)


def make_stack(nats_server: EmbeddedNats, model_dir: str, log_dir: Path, workers: int = 2,
               specs: tuple[WorkerSpec, ...] = (), router_args: tuple[str, ...] = (), *,
               engine: str = "sim", ttl_s: float = 1.5, start_timeout_s: float = 0.0) -> LocalStack:
    """A stack (not started) of `workers` default workers named w1, w2, ... then `specs`."""
    return LocalStack(StackConfig(
        model_dir=model_dir,
        engine=engine,
        workers=(*(WorkerSpec(worker_id=f"w{i + 1}") for i in range(workers)), *specs),
        router_port=0,
        metrics_port=0,
        nats_url=nats_server.url,
        namespace=engine + uuid.uuid4().hex[:10],
        heartbeat_interval_s=0.2,
        ttl_s=ttl_s,
        log_dir=str(log_dir),
        router_args=router_args,
        start_timeout_s=start_timeout_s,
    ))


@contextmanager
def running(stack: LocalStack) -> Iterator[LocalStack]:
    """The stack started; stopped at the end with no process left behind (those started
    during the test included)."""
    stack.start()
    pids = {process.pid for process in stack.processes.values()}
    try:
        yield stack
    finally:
        pids |= {process.pid for process in stack.processes.values()}
        stack.stop()
    left = sorted(pid for pid in pids if group_members(pid) or _state(pid) not in ("", "Z"))
    assert not left, f"processes left behind: {left}"


def _state(pid: int) -> str:
    """A process's state letter ("Z": a zombie, not yet reaped), "" when there is none."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def group_members(pgid: int) -> list[int]:
    """Live processes of a process group (each stack process leads its own: an engine's
    processes are in its worker's)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            members.append(int(entry.name))
    return members


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU time of every live process in the group, all threads."""
    total = 0.0
    for pid in group_members(pgid):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


async def collect(bus: Bus, record_type: type, subject: str) -> list[Any]:
    """A list that every record published on `subject` from now on is appended to."""
    records: list[Any] = []
    codec: Codec[Any] = Codec(record_type)

    async def on_record(msg) -> None:
        record = codec.decode_or_none(msg.data, msg.subject)
        if record is not None:
            records.append(record)

    await bus.client.subscribe(subject, cb=on_record)
    await bus.client.flush()
    return records


@asynccontextmanager
async def request_records(stack: LocalStack, client_name: str) -> AsyncIterator[list[RequestRecord]]:
    """The stack's request records from now on, collected on a bus client of their own until the end."""
    async with await connect(stack.nats_url, client_name) as bus:
        yield await collect(bus, RequestRecord, Subjects(stack.config.namespace).request_events)


async def records_arrived(records: list, count: int, timeout_s: float = 5.0) -> None:
    await wait_for(lambda: len(records) >= count, timeout_s, lambda: f"{count} records ({len(records)} arrived)")


class LoadWatcher(LatestLoads):
    """The latest load report of every worker, read straight off the bus, and waits on them."""

    def idle(self, worker_ids: list[str]) -> bool:
        snaps = [self.latest.get(w) for w in worker_ids]
        return all(s is not None and s.running == 0 and s.waiting == 0 and s.kv_used_blocks == 0 for s in snaps)

    async def wait_idle(self, worker_ids: list[str], timeout_s: float = 10.0) -> None:
        """Every listed worker reports no running or waiting request and no used KV block."""
        await wait_for(lambda: self.idle(worker_ids), timeout_s,
                       lambda: f"KV pools back to baseline: {self.latest}")

    async def fresh_reports(self, worker_ids: list[str], count: int = 2, timeout_s: float = 10.0) -> None:
        """`count` more reports from each worker than have arrived so far. The last one was
        taken after this call (at most one was on its way), so its cumulative counters
        include everything the worker did before the call."""
        seen = {w: self.latest[w].seq if w in self.latest else 0 for w in worker_ids}
        await wait_for(lambda: all(w in self.latest and self.latest[w].seq >= seen[w] + count for w in worker_ids),
                       timeout_s, lambda: f"{count} new load reports from each of {worker_ids}: {self.latest}")


class StackObserver:
    """Load reports and KV transfer records of one stack, straight off the bus."""

    def __init__(self, bus: Bus, namespace: str, workers: tuple[str, ...]) -> None:
        self.bus = bus
        self.subjects = Subjects(namespace)
        self.workers = workers
        self.loads = LoadWatcher()
        self.records: list[TransferRecord] = []

    async def start(self) -> None:
        await self.loads.start(self.bus, self.subjects.load_all)
        self.records = await collect(self.bus, TransferRecord, self.subjects.kv_transfers_all)

    def counter(self, worker_id: str, name: str) -> int:
        return getattr(self.loads.latest[worker_id], name)

    def leases(self, worker_id: str) -> int:
        """The leases a worker holds by its latest report; -1 before its first."""
        snapshot = self.loads.latest.get(worker_id)
        return -1 if snapshot is None else snapshot.active_leases

    async def settled(self, worker_id: str, name: str) -> int:
        """A cumulative counter once it counts everything done before this call, on an
        idle worker: a report taken after the call that shows no request in flight."""
        await self.loads.fresh_reports([worker_id])
        await self.loads.wait_idle([worker_id])
        return self.counter(worker_id, name)

    async def assert_clean(self, timeout_s: float = 20.0) -> None:
        """No request, used block or lease left on any worker (within `timeout_s`)."""
        await self.loads.wait_idle(list(self.workers), timeout_s)
        await wait_for(lambda: not any(self.loads.latest[w].active_leases for w in self.workers), timeout_s,
                       lambda: f"every lease released: {self.loads.latest}")


@asynccontextmanager
async def observing(stack: LocalStack, workers: tuple[str, ...], client_name: str = "test-observer",
                    ) -> AsyncIterator[StackObserver]:
    """A `StackObserver` of the stack, once each of `workers` has reported its load."""
    bus = await connect(stack.nats_url, client_name)
    try:
        observer = StackObserver(bus, stack.config.namespace, workers)
        await observer.start()
        await wait_for(lambda: all(w in observer.loads.latest for w in workers), 10,
                       f"a load report from each of {list(workers)}")
        yield observer
    finally:
        await bus.close()
