"""Is a started service ready? Asked of the service itself, never read from its log.

- HTTP services (router, metrics collector): their health path answers 200.
- Workers: registered in the membership bucket by the process the launcher started (the
  registration's pid is the child's), so a stale registration of a killed predecessor with
  the same worker id does not count.

Every wait has a deadline and fails fast, with the service's log tail, when the process
exits. Callers are synchronous (the launcher, the tests' fixtures, also from inside a
running event loop): the membership wait runs its NATS client on a thread of its own.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec

from launch.process import ManagedProcess
from shared.config import BusConfig
from shared.schemas.membership import WorkerRegistration
from shared.subjects import Subjects

POLL_S = 0.05


def free_port(host: str) -> int:
    """A port nothing listens on now (it may be taken the next moment: for a service's own
    port use `reserve_port`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def reserve_port(host: str) -> socket.socket:
    """A free port for a service asked to pick one (port 0), held until the service listens
    on it: the launcher needs the port to probe the service's health, and a port only looked
    up could be taken, before the service binds it, by any program's bind or outgoing
    connection. The socket is bound, never listening, with SO_REUSEADDR and SO_REUSEPORT, so
    the service (whose sockets set SO_REUSEADDR) binds and listens beside it while no other
    bind without those options succeeds and no outgoing connection gets the port. Close it
    once the service answers (`getsockname()[1]` is the port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, 0))
    except BaseException:
        sock.close()
        raise
    return sock


def _check_alive(process: ManagedProcess) -> None:
    if not process.alive:
        raise RuntimeError(f"{process.name} exited with {process.popen.returncode}:\n{process.log_tail()}")


def _timed_out(process: ManagedProcess, what: str, timeout_s: float) -> TimeoutError:
    return TimeoutError(f"{process.name}: {what} within {timeout_s:g}s:\n{process.log_tail()}")


def wait_http_ok(process: ManagedProcess, url: str, timeout_s: float) -> None:
    """Until GET `url` answers 200."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while True:
            _check_alive(process)
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise _timed_out(process, f"{url} did not answer 200", timeout_s)
            time.sleep(POLL_S)


def wait_registered(nats_url: str | BusConfig, namespace: str, workers: Mapping[str, ManagedProcess], timeout_s: float) -> None:
    """Until every worker id in `workers` is registered by its process."""
    if not workers:
        return
    with ThreadPoolExecutor(1, thread_name_prefix="tandem-readiness") as thread:
        thread.submit(asyncio.run, _registered(nats_url, namespace, dict(workers), timeout_s)).result()


async def _registered(nats_url: str | BusConfig, namespace: str, pending: dict[str, ManagedProcess], timeout_s: float) -> None:
    from nats.js.errors import BucketNotFoundError, KeyNotFoundError

    from shared.bus import connect

    deadline = time.monotonic() + timeout_s
    bucket = Subjects(namespace).members_bucket
    bus = await connect(nats_url, "tandem-launcher")
    try:
        members = None
        while pending:
            for process in pending.values():
                _check_alive(process)
            try:
                members = members or await bus.js.key_value(bucket)
            except BucketNotFoundError:
                pass  # no worker has registered yet
            for worker_id, process in list(pending.items()):
                try:
                    entry = await members.get(worker_id) if members is not None else None
                except KeyNotFoundError:
                    continue
                if entry is not None and entry.value and _registered_pid(entry.value) == process.pid:
                    del pending[worker_id]
            if pending and time.monotonic() > deadline:
                raise _timed_out(next(iter(pending.values())), "not registered as a worker", timeout_s)
            if pending:
                await asyncio.sleep(POLL_S)
    finally:
        await bus.close()


def _registered_pid(value: bytes) -> int | None:
    try:
        return msgspec.msgpack.decode(value, type=WorkerRegistration).pid
    except msgspec.DecodeError:
        return None
