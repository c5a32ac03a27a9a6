"""The report socket: the connector's two sides -> the Tandem worker (ZMQ PUSH -> PULL, ipc).

The connector runs in vLLM's EngineCore (scheduler side) and model-worker (worker side)
processes; what they must tell the Tandem worker (`kv_wire.Report`: blocks pinned for a
lease, the outcome of a pull) travels on one ipc socket the worker binds in its private
directory, next to the KV-event sockets. Sending never blocks an engine step: a report
that cannot be queued is dropped and logged, and the worker's bounded wait for it turns
into an explicit failure.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from connector.vllm.kv_wire import Report, decode_report, encode_report

log = logging.getLogger(__name__)


class ReportSink(Protocol):
    """Where a rank's reports go: a `ReportSender` (the report socket), the worker side's
    counter-stamping wrapper (`connector_worker.CountedReports`), a list in tests."""

    def send(self, report: Report) -> None: ...


class ReportSender:
    """Lives in a vLLM process; `send` is called on that process's engine thread."""

    def __init__(self, endpoint: str) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)

    def send(self, report: Report) -> None:
        try:
            self._socket.send(encode_report(report), zmq.NOBLOCK)
        except zmq.ZMQError as error:
            log.warning("dropped a KV connector report %s: %s", type(report).__name__, error)

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


class ReportReceiver:
    """Lives in the Tandem worker: one task on its loop hands each report to `on_report`."""

    def __init__(self, endpoint: str, on_report: Callable[[Report], None]) -> None:
        self.endpoint = endpoint
        self._on_report = on_report
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.malformed = 0

    def start(self) -> None:
        """Bind before vLLM starts: its processes connect while they come up."""
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.bind(self.endpoint)
        self._task = asyncio.create_task(self._run(), name="vllm-kv-reports")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._socket is not None:
            self._socket.close(linger=0)
        if self._context is not None:
            self._context.term()

    async def _run(self) -> None:
        assert self._socket is not None
        while True:
            payload = await self._socket.recv()
            try:
                report = decode_report(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.malformed += 1
                log.warning("undecodable KV connector report (%d bytes)", len(payload))
                continue
            try:
                self._on_report(report)
            except Exception:  # a bug in one handler must not stop the reports
                log.exception("handling KV connector report %r failed", report)
