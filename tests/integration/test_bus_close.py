"""A service's bus closes for good even when its server is gone and the close's cancel of
the reconnect loop is lost.

nats-py's `close` cancels the loop that reconnects to a dead server; on Python 3.11
`asyncio.wait_for` can swallow that cancel when a refused attempt ends at the same moment,
and an unbounded loop would then retry for ever, keeping a stopping service alive (seen in
`tests/chaos/test_stop_without_nats.py`: a worker still retrying 12 s after its SIGTERM).
Here the loop is hidden from the close (so its cancel is never sent, as if lost): after
`Bus.close` it must still end by itself within a few reconnect waits.
"""

from __future__ import annotations

import asyncio

from shared.bus import RECONNECT_WAIT_S, connect
from shared.nats_server import EmbeddedNats


class _Finished:
    """Stands in for the client's reconnect task during the close: looks done, so the
    close sends the real one no cancel."""

    def done(self) -> bool:
        return True


async def test_a_reconnect_loop_whose_cancel_was_lost_still_ends_after_close(tmp_path) -> None:
    with EmbeddedNats(str(tmp_path / "nats")) as nats:
        bus = await connect(nats.url, "test-service", connect_timeout_s=5.0)
        assert nats.process is not None
        nats.process.kill()
        nats.process.wait()
    client = bus.client
    for _ in range(100):  # the loop starts once the client sees the server go
        if client._reconnection_task is not None and not client.is_connected:
            break
        await asyncio.sleep(0.05)
    reconnecting = client._reconnection_task
    assert reconnecting is not None and not reconnecting.done()
    await asyncio.sleep(3 * RECONNECT_WAIT_S)  # refused attempts: it keeps trying
    assert not reconnecting.done()
    client._reconnection_task = _Finished()
    await bus.close()
    await asyncio.wait_for(asyncio.shield(reconnecting), 10 * RECONNECT_WAIT_S)
    assert client.is_closed
