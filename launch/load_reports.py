"""Each worker's latest load report, read straight off the bus (adapter): how a local
stack's observers (the soak benchmark, the whole-stack tests) see what its workers hold.
No ordering or membership checks: for a consumer that serves requests, see
`shared.cluster.load_stream`."""

from __future__ import annotations

from nats.aio.msg import Msg

from shared.bus import Bus
from shared.codec import Codec
from shared.schemas import LoadSnapshot


class LatestLoads:
    def __init__(self) -> None:
        self.latest: dict[str, LoadSnapshot] = {}
        self._codec: Codec[LoadSnapshot] = Codec(LoadSnapshot)

    async def start(self, bus: Bus, subject: str) -> None:
        """Keep the latest report of every worker publishing on `subject` (`Subjects.load_all`)."""
        await bus.client.subscribe(subject, cb=self._on_load)

    async def _on_load(self, msg: Msg) -> None:
        snapshot = self._codec.decode_or_none(msg.data, msg.subject)
        if snapshot is not None:
            self.latest[snapshot.worker_id] = snapshot
