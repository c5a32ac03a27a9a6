"""Routers sharing their predicted load (`SharedLoadLink`) against a real nats-server: each
sees the other's figures within milliseconds of a change, a router that stops is forgotten
at once, and one that falls silent (killed) after its missed heartbeats."""

from __future__ import annotations

from collections.abc import Collection

from services.router.fleet.shared_load import NO_REMOTE_LOAD, RemoteLoad
from services.router.fleet.shared_load_link import SharedLoadLink
from shared.bus import connect
from shared.codec import MalformedCounter
from shared.config import BusConfig
from shared.schemas import RoutedLoad, RoutedPrompt
from tests.waiting import wait_for

DEADLINE_S = 5.0


class Ledger:
    """A router's own figures, per worker: what the worker pool would report."""

    def __init__(self) -> None:
        self.figures: dict[str, tuple[int, int]] = {}

    def own(self, worker_ids: Collection[str] | None) -> list[RoutedLoad]:
        names = list(self.figures) if worker_ids is None else worker_ids
        return [RoutedLoad(worker_id=name, in_flight=self.figures.get(name, (0, 0))[0],
                           prefill_tokens=self.figures.get(name, (0, 0))[1]) for name in names]


async def test_two_routers_share_their_load_and_forget_a_stopped_or_silent_one(bus_config: BusConfig) -> None:
    ledgers = [Ledger(), Ledger()]
    buses = [await connect(bus_config, f"router-{index}") for index in range(2)]
    predicted: list[RoutedPrompt] = []  # the prompts the first router routed, as the second hears of them
    links = [SharedLoadLink(bus, bus_config.subjects, MalformedCounter(), ledger.own, interval_s=0.2,
                            on_peer_prediction=on_peer)
             for bus, ledger, on_peer in zip(buses, ledgers, (None, predicted.append))]
    first, second = links
    try:
        for link in links:
            await link.start()
        await wait_for(lambda: first.peers.peers == [second.router_id] and second.peers.peers == [first.router_id],
                       DEADLINE_S, "the routers find each other")
        ledgers[0].figures["w1"] = (2, 300)
        first.changed("w1")
        await wait_for(lambda: second.remote("w1") == RemoteLoad(2, 300), DEADLINE_S, "a change reaches the peer")
        ledgers[0].figures["w1"] = (0, 0)
        ledgers[0].figures["w2"] = (1, 0)
        first.changed("w1")
        first.changed("w2")
        await wait_for(lambda: second.peers.totals() == {"w2": RemoteLoad(1, 0)}, DEADLINE_S, "changes coalesce")
        # a routed prompt's hash chain reaches the peer, which predicts its blocks there
        first.predicted("w2", {16: [11, 12, 13]}, 2.0)
        await wait_for(lambda: predicted == [RoutedPrompt(worker_id="w2", chains={16: [11, 12, 13]}, ttl_s=2.0)],
                       DEADLINE_S, "the prediction reaches the peer")
        # a stopped router says so: forgotten before its heartbeats would have expired
        await first.stop()
        await wait_for(lambda: second.peers.peers == [], 0.3, "a stopped router is forgotten at once")
        assert second.remote("w2") is NO_REMOTE_LOAD

        # a router that falls silent (its connection cut, as by kill -9) expires
        third_ledger = Ledger()
        third_ledger.figures["w3"] = (4, 0)
        third_bus = await connect(bus_config, "router-3")
        third = SharedLoadLink(third_bus, bus_config.subjects, MalformedCounter(), third_ledger.own, interval_s=0.2)
        await third.start()
        await wait_for(lambda: second.remote("w3") == RemoteLoad(4, 0), DEADLINE_S, "the third router's load")
        assert third.remote("w3") is NO_REMOTE_LOAD  # its own figures are not a peer's
        third._heartbeat.cancel()  # as good as dead: nothing more goes out
        await third_bus.client.close()
        waited = await wait_for(lambda: second.peers.peers == [], DEADLINE_S, "the silent router expires")
        assert waited >= 0.5  # not before its missed heartbeats (1 s floor, from its last message)
        assert second.peers.totals() == {}
        await third.stop()  # its leaving message cannot go out any more: nothing raises
    finally:
        for link in links:
            await link.stop()
        for bus in buses:
            await bus.close()
