"""A command line tool's first connection gives up; a service's keeps trying.

No server listens on the port (taken from the kernel, then closed): `connect` with
`give_up_after_s` raises `BusConnectError` naming the URL and the last error within that
bound, and `tandem ctl` says so and exits non-zero instead of retrying for ever. Without
it `connect` is still trying when the test stops waiting, and it connects once a server
comes up on that port.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import pytest

from shared.bus import BusConnectError, connect
from shared.nats_server import EmbeddedNats


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def test_a_bounded_first_connection_gives_up_with_the_reason() -> None:
    url = f"nats://127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    with pytest.raises(BusConnectError) as caught:
        await connect(url, "test-tool", connect_timeout_s=1.0, give_up_after_s=1.5)
    elapsed = time.monotonic() - started
    assert 1.4 <= elapsed < 5, elapsed
    assert url in str(caught.value) and "within 1.5 s" in str(caught.value), caught.value


async def test_an_unbounded_first_connection_keeps_trying_until_a_server_comes() -> None:
    port = _closed_port()
    attempt = asyncio.create_task(connect(f"nats://127.0.0.1:{port}", "test-service", connect_timeout_s=1.0))
    try:
        await asyncio.sleep(1.5)  # refused attempts for longer than a tool's bound: still trying
        assert not attempt.done()
        with EmbeddedNats(port=port):
            bus = await asyncio.wait_for(attempt, 30)
            try:
                assert bus.client.is_connected
            finally:
                await bus.close()
    finally:
        attempt.cancel()


def test_tandem_ctl_without_a_server_says_so_within_its_timeout() -> None:
    url = f"nats://127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "cli.main", "ctl", "workers", "--nats-url", url, "--timeout", "2"],
                          capture_output=True, text=True, timeout=60)
    assert time.monotonic() - started < 30
    assert done.returncode != 0
    assert "no NATS server answered" in done.stderr and url in done.stderr, done.stderr
