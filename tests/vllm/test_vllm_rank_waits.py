"""On a CPU host vLLM's ranks pause between looks at their queue instead of spinning or
waiting on its notification socket (`connector.vllm.rank_waits`): importing Tandem's
connector, as each rank does, sets it for the readers created afterwards."""

from __future__ import annotations

import time

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")

from vllm.distributed.device_communicators import shm_broadcast  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402

import connector.vllm.tandem_connector  # noqa: E402,F401  (as a rank imports it)
from connector.vllm.rank_waits import (  # noqa: E402
    FIRST_PAUSE_S,
    LONGEST_PAUSE_S,
    WAITING_SINCE,
    pause_seconds,
    quiet_rank_waits,
)

pytestmark = pytest.mark.skipif(not current_platform.is_cpu(), reason="the ranks spin on GPU hosts, as vLLM chose")


@pytest.fixture
def conditions():
    """A writer and its reader, as in vLLM's queues (the reader connects to a writer bound
    first: a CONFLATE reader connected to an inproc address nobody bound makes libzmq abort
    in `term()` now and then, "Assertion failed: ok (src/ctx.cpp:789)", seen in CI)."""
    context = zmq.Context()
    writer = shm_broadcast.SpinCondition(is_reader=False, context=context, notify_address="inproc://tandem-test")
    reader = shm_broadcast.SpinCondition(is_reader=True, context=context, notify_address="inproc://tandem-test")
    try:
        yield writer, reader
    finally:
        for socket in (reader.local_notify_socket, reader.read_cancel_socket, reader.write_cancel_socket,
                       writer.local_notify_socket):
            socket.close(linger=0)
        context.term()


def test_a_cpu_ranks_queue_reader_pauses_and_its_writer_is_vllms(conditions) -> None:
    writer, reader = conditions
    assert quiet_rank_waits()  # already in force: the import did it, and doing it again is harmless
    assert "wait" in vars(reader) and "wait" not in vars(writer)
    writer.notify()  # a notification changes nothing: the reader does not read the socket


def test_a_waiting_reader_sleeps_and_does_not_spin(conditions) -> None:
    """Waiting 0.3 s from a message on: vLLM's reader would spin (`sched_yield`) for its
    second-long window, and a poll that stops sleeping uses the core whole too."""
    _, reader = conditions
    reader.record_read()
    wall, cpu, waits = time.perf_counter(), time.thread_time(), 0
    while time.perf_counter() - wall < 0.3:
        reader.wait(timeout_ms=5)
        waits += 1
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    assert cpu < 0.25 * wall, (cpu, wall, waits)
    assert waits < 0.3 / FIRST_PAUSE_S  # it slept between looks


def test_the_pause_is_timed_from_the_first_wait_after_a_message_not_from_the_message(conditions) -> None:
    """A rank reads a step's message as the step starts: a long step is no long wait."""
    _, reader = conditions
    reader.last_read = time.monotonic() - 10.0  # a step of 10 s
    before = time.monotonic()
    reader.wait(timeout_ms=5)
    first = getattr(reader, WAITING_SINCE)
    assert first >= before
    reader.wait(timeout_ms=5)
    assert getattr(reader, WAITING_SINCE) == first  # the same wait goes on
    reader.record_read()
    reader.wait(timeout_ms=5)
    assert getattr(reader, WAITING_SINCE) > first  # a new message: a new wait


def test_the_pause_grows_with_the_wait_within_bounds_and_the_timeout() -> None:
    assert pause_seconds(0.0, None) == FIRST_PAUSE_S  # as a reader begins to wait
    assert pause_seconds(8 * 0.5e-3, None) == 0.5e-3
    assert pause_seconds(10.0, None) == LONGEST_PAUSE_S  # idle: a wake-up per millisecond
    assert pause_seconds(10.0, 0) == 0.0 and pause_seconds(10.0, -3) == 0.0  # the caller's deadline comes first
