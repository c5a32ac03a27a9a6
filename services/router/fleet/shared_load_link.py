"""Sharing predicted load between routers over NATS (adapter around `shared_load`).

Each router process has a random id and publishes its contribution (`RouterLoad`: per
worker, its requests in flight and their prompt tokens still waiting for prefill) on
`Subjects.router_load(id)`:

- all of it every `interval_s` (a heartbeat, even when idle, so that peers find it and know
  it lives);
- the workers whose figures changed (a routing decision, a first token, an end),
  `flush_delay_s` after the first change, every change in that window in one message, but
  only while it has peers: a lone router pays nothing per request, and a message stays
  small however many workers there are;
- all of it at once when a new peer appears (the newcomer learns what is in flight), and
  once more, `leaving`, when it stops.

With the changes go the prompts routed since the last message (`predicted`): a peer's are
handed to `on_peer_prediction`, given at construction (the router's
`flows.routing_state.RoutedPrompts.peer_routed`: their blocks predicted in its KV index,
their prefixes recorded in its placement).

It merges what its peers publish (`PeerLoads`; its own messages, which NATS echoes back on
the same subscription, are dropped by subject, unread); a peer silent for a few of its heartbeat
periods is forgotten (it died: `kill -9`, a lost link), so its contribution stops counting.
The worker pool adds `remote(worker_id)` to its own ledger's counts.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Collection

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from services.router.fleet.shared_load import PeerLoads, RemoteLoad
from shared.bus import Bus
from shared.codec import Codec, MalformedCounter, encode
from shared.schemas import RoutedLoad, RoutedPrompt, RouterLoad
from shared.subjects import Subjects

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5  # a router's contribution goes out at least this often
# changes within this window go out in one message: a tenth of the workers' load report period
# (250 ms), so a peer still hears of a routed prompt well before its worker's KV events; at a
# few hundred requests a second, about one message per 6-8 requests, not one per 2
FLUSH_DELAY_S = 0.025

# the router's own figures: of these workers (zeros included), or None: of every worker it has load on
OwnLoad = Callable[[Collection[str] | None], list[RoutedLoad]]
PeerPrediction = Callable[[RoutedPrompt], None]


def new_router_id() -> str:
    return f"router-{secrets.token_hex(6)}"


class SharedLoadLink:
    def __init__(self, bus: Bus, subjects: Subjects, malformed: MalformedCounter,
                 own: OwnLoad, *, on_peer_prediction: PeerPrediction | None = None, router_id: str = "",
                 interval_s: float = HEARTBEAT_S, flush_delay_s: float = FLUSH_DELAY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.router_id = router_id or new_router_id()
        self.peers = PeerLoads(self.router_id)
        self._bus = bus
        self._subjects = subjects
        self._own = own
        self._interval_s = interval_s
        self._flush_delay_s = flush_delay_s
        self._clock = clock
        self._codec: Codec[RouterLoad] = Codec(RouterLoad, malformed)
        self._own_subject = subjects.router_load(self.router_id)
        self._seq = 0
        self._subscription: Subscription | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._flush: asyncio.TimerHandle | None = None
        self._changed: set[str] = set()  # workers whose figures changed since the last message
        self._predictions: list[RoutedPrompt] = []  # prompts routed since the last message
        self._on_peer_prediction = on_peer_prediction  # a peer routed a prompt
        self._sending: set[asyncio.Task[None]] = set()

    def remote(self, worker_id: str) -> RemoteLoad:
        return self.peers.remote(worker_id)

    async def start(self) -> None:
        self._subscription = await self._bus.client.subscribe(self._subjects.router_load_all, cb=self._on_message)
        await self._publish()
        self._heartbeat = asyncio.create_task(self._beat())

    async def stop(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
            self._heartbeat = None
        if self._subscription is None:
            return
        try:  # peers forget us now rather than after our heartbeats stop
            await self._publish(leaving=True)
            await self._subscription.unsubscribe()
        except Exception as error:  # the connection is already gone: peers will expire us
            log.debug("leaving the shared load failed: %s", error)
        self._subscription = None
        await asyncio.gather(*self._sending, return_exceptions=True)

    def changed(self, worker_id: str) -> None:
        """Our figures for `worker_id` changed: tell the peers soon (coalesced), when there are any."""
        if not self.peers.peers or self._subscription is None:
            return
        self._changed.add(worker_id)
        self._schedule_flush()

    def predicted(self, worker_id: str, chains: dict[int, list[int]], ttl_s: float) -> None:
        """We routed a prompt to `worker_id` and predict its blocks there: so will the peers."""
        if not self.peers.peers or self._subscription is None or not chains:
            return
        self._predictions.append(RoutedPrompt(worker_id=worker_id, chains=chains, ttl_s=ttl_s))
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(self._flush_delay_s, self._flush_now)

    def _flush_now(self, *, full: bool = False) -> None:
        self._flush = None
        if not full and not self._changed and not self._predictions:
            return
        task = asyncio.get_running_loop().create_task(self._publish(full=full))
        self._sending.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._sending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("publishing the shared load failed: %s", task.exception())

    async def _publish(self, *, full: bool = True, leaving: bool = False) -> None:
        # built when sent (not when scheduled), so it carries the figures of that moment
        changed, self._changed = self._changed, set()
        predictions, self._predictions = self._predictions, []
        workers = [] if leaving else self._own(None if full else changed)
        self._seq += 1
        message = RouterLoad(router_id=self.router_id, seq=self._seq, interval_s=self._interval_s,
                             workers=workers, full=full, predictions=[] if leaving else predictions,
                             leaving=leaving)
        await self._bus.client.publish(self._subjects.router_load(self.router_id), encode(message))

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)  # a period, not a synchronisation
            for router_id in self.peers.expire(self._clock()):
                log.warning("router %s stopped sharing its load: its requests no longer count", router_id)
            try:
                await self._publish()
            except Exception as error:  # disconnected: the next beat tries again
                log.debug("shared load heartbeat failed: %s", error)

    async def _on_message(self, msg: Msg) -> None:
        if msg.subject == self._own_subject:  # our own message, echoed by NATS: nothing in it for us
            return
        self.receive(msg.data, msg.subject)

    def receive(self, data: bytes, subject: str) -> None:
        message = self._codec.decode_or_none(data, subject)
        if message is None:
            return
        if message.leaving and message.router_id in self.peers.peers:
            log.info("router %s left", message.router_id)
        if message.router_id != self.router_id and self._on_peer_prediction is not None:
            for prediction in message.predictions:
                self._on_peer_prediction(prediction)
        if self.peers.apply(message, self._clock()) and self._subscription is not None:
            log.info("router %s shares its load with this one (%s)", message.router_id, self.router_id)
            if self._flush is not None:
                self._flush.cancel()
            self._flush_now(full=True)  # the newcomer learns what we have in flight
