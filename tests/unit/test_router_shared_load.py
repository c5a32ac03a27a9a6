"""Sharing predicted load between routers, on plain data: merging peers' contributions
(`PeerLoads`), expiring a silent peer, and what the worker pool predicts with them."""

from __future__ import annotations

from services.router.fleet.shared_load import NO_REMOTE_LOAD, PeerLoads, RemoteLoad
from services.router.fleet.shared_load_link import SharedLoadLink
from shared.codec import MalformedCounter, encode
from shared.schemas import RoutedLoad, RoutedPrompt, RouterLoad
from shared.subjects import Subjects
from tests.unit.test_router_worker_pool import pool_with, report, view


def load(router_id: str, seq: int, *workers: tuple[str, int, int], interval_s: float = 0.5, full: bool = True,
         leaving: bool = False) -> RouterLoad:
    return RouterLoad(router_id=router_id, seq=seq, interval_s=interval_s, full=full, leaving=leaving,
                      workers=[RoutedLoad(worker_id=w, in_flight=n, prefill_tokens=t) for w, n, t in workers])


def test_peers_contributions_add_up_per_worker_and_replace_their_previous_one() -> None:
    peers = PeerLoads("me")
    assert peers.apply(load("a", 1, ("w1", 2, 300)), now=0.0)  # a new peer
    assert peers.apply(load("b", 1, ("w1", 1, 0), ("w2", 1, 50)), now=0.0)
    assert peers.remote("w1") == RemoteLoad(3, 300)
    assert peers.remote("w2") == RemoteLoad(1, 50)
    assert not peers.apply(load("a", 2, ("w2", 1, 10)), now=0.1)  # a's whole contribution now
    assert peers.remote("w1") == RemoteLoad(1, 0)
    assert peers.remote("w2") == RemoteLoad(2, 60)
    assert peers.remote("w3") is NO_REMOTE_LOAD
    assert peers.peers == ["a", "b"]


def test_a_partial_message_replaces_the_workers_it_names_only() -> None:
    peers = PeerLoads("me")
    assert peers.apply(load("a", 1, ("w1", 2, 300), ("w2", 1, 0)), now=0.0)
    peers.apply(load("a", 2, ("w1", 3, 350), full=False), now=0.0)  # one more request on w1
    assert peers.totals() == {"w1": RemoteLoad(3, 350), "w2": RemoteLoad(1, 0)}
    peers.apply(load("a", 3, ("w2", 0, 0), ("w3", 1, 20), full=False), now=0.0)  # w2's ended; w3 new
    assert peers.totals() == {"w1": RemoteLoad(3, 350), "w3": RemoteLoad(1, 20)}
    peers.apply(load("a", 4, ("w3", 1, 0)), now=0.0)  # a full one: what it does not name is gone
    assert peers.totals() == {"w3": RemoteLoad(1, 0)}
    # a partial message from a peer not seen yet counts at once (its full one follows)
    assert peers.apply(load("b", 7, ("w3", 1, 5), full=False), now=0.0)
    assert peers.remote("w3") == RemoteLoad(2, 5)


def test_old_duplicate_and_own_messages_change_nothing() -> None:
    peers = PeerLoads("me")
    peers.apply(load("a", 5, ("w1", 2, 0)), now=0.0)
    peers.apply(load("a", 4, ("w1", 9, 0)), now=0.0)  # late
    peers.apply(load("a", 5, ("w1", 9, 0)), now=0.0)  # duplicate
    assert peers.stale == 2
    assert not peers.apply(load("me", 1, ("w1", 7, 0)), now=0.0)  # our own, echoed back by NATS
    assert peers.remote("w1") == RemoteLoad(2, 0)
    assert peers.peers == ["a"]


def test_negative_counts_are_taken_as_nothing_and_empty_workers_are_not_kept() -> None:
    peers = PeerLoads("me")
    peers.apply(load("a", 1, ("w1", -3, -10), ("w2", 0, 0), ("w3", 1, 0), ("w3", 1, 5)), now=0.0)
    assert peers.totals() == {"w3": RemoteLoad(2, 5)}
    peers.apply(load("a", 2), now=0.0)  # idle now: a heartbeat with nothing in flight
    assert peers.totals() == {}
    assert peers.peers == ["a"]


def test_a_silent_peer_expires_after_missed_heartbeats_and_a_leaving_one_at_once() -> None:
    peers = PeerLoads("me", missed_heartbeats=4, min_ttl_s=1.0)
    peers.apply(load("a", 1, ("w1", 2, 100), interval_s=0.5), now=10.0)
    peers.apply(load("b", 1, ("w1", 1, 0), interval_s=0.1), now=10.0)  # 4 x 0.1 < the 1 s floor
    assert peers.expire(10.9) == []
    assert peers.expire(11.0) == ["b"]
    assert peers.remote("w1") == RemoteLoad(2, 100)
    peers.apply(load("a", 2, ("w1", 2, 100), interval_s=0.5), now=11.5)  # a heartbeat extends it
    assert peers.expire(12.0) == []
    assert peers.expire(13.5) == ["a"]
    assert peers.totals() == {} and peers.peers == []
    # a router that stops says so: forgotten without waiting
    assert peers.apply(load("c", 1, ("w2", 1, 0)), now=20.0)
    peers.apply(load("c", 2, leaving=True), now=20.1)
    assert peers.totals() == {} and peers.peers == []


def test_a_worker_that_left_is_forgotten_in_every_peers_contribution() -> None:
    peers = PeerLoads("me")
    peers.apply(load("a", 1, ("w1", 2, 0), ("w2", 1, 0)), now=0.0)
    peers.worker_left("w1")
    assert peers.totals() == {"w2": RemoteLoad(1, 0)}
    peers.apply(load("a", 2, ("w2", 1, 0)), now=0.0)  # replacing it subtracts only what is still there
    assert peers.totals() == {"w2": RemoteLoad(1, 0)}


def test_the_pool_predicts_with_the_other_routers_requests() -> None:
    pool = pool_with("w1", "w2")
    peers = pool.shared_load.peers
    ours = pool.begin("w1", "r1", prefill_tokens=100)
    peers.apply(load("other", 1, ("w1", 2, 400)), now=0.0)
    w1 = view(pool, "w1")
    assert (w1.predicted_load, w1.predicted_prefill_tokens) == (3, 500)
    assert view(pool, "w2").predicted_load == 0
    # a load report already counts what every router had routed there when it arrived
    report(pool, "w1", seq=1, running=3, pending_prefill_tokens=500)
    assert (view(pool, "w1").predicted_load, view(pool, "w1").predicted_prefill_tokens) == (3, 500)
    peers.apply(load("other", 2, ("w1", 2, 0)), now=0.0)  # its prompts reached their first token
    assert view(pool, "w1").predicted_prefill_tokens == 100
    ours.end()
    peers.apply(load("other", 3), now=0.0)
    assert view(pool, "w1").predicted_load == 0  # the report less everything that ended since


def test_the_pool_publishes_its_own_contribution() -> None:
    pool = pool_with("w1", "w2")
    pool.begin("w1", "r1", prefill_tokens=100)
    pool.begin("w1", "r2", prefill_tokens=20).prefill_done()
    assert pool._own_load() == [RoutedLoad(worker_id="w1", in_flight=2, prefill_tokens=100)]
    # the workers that changed, zeros included (a worker that left is nothing there)
    assert pool._own_load(["w1", "w2", "gone"]) == [RoutedLoad(worker_id="w1", in_flight=2, prefill_tokens=100),
                                                    RoutedLoad(worker_id="w2", in_flight=0, prefill_tokens=0),
                                                    RoutedLoad(worker_id="gone", in_flight=0, prefill_tokens=0)]


def test_the_link_decodes_what_it_receives_and_counts_malformed_messages() -> None:
    malformed = MalformedCounter()
    predicted: list[RoutedPrompt] = []
    link = SharedLoadLink(None, Subjects("t"), malformed, lambda: [], router_id="me",  # type: ignore[arg-type]
                          clock=lambda: 0.0, on_peer_prediction=predicted.append)
    link.receive(b"\x01garbage", "router.load.x")
    prompt = RoutedPrompt(worker_id="w1", chains={16: [1, 2, 3]}, ttl_s=2.0)
    link.receive(encode(RouterLoad(router_id="me", seq=1, interval_s=0.5, predictions=[prompt])), "router.load.me")
    assert malformed.total == 1 and link.peers.peers == [] and predicted == []  # our own: already predicted
    link.receive(encode(RouterLoad(router_id="peer", seq=1, interval_s=0.5, full=False, predictions=[prompt])),
                 "router.load.peer")
    assert predicted == [prompt] and link.peers.peers == ["peer"]


class _Msg:
    def __init__(self, subject: str, data: bytes) -> None:
        self.subject, self.data = subject, data


async def test_the_link_skips_its_own_messages_echoed_back_without_decoding_them() -> None:
    malformed, subjects = MalformedCounter(), Subjects("t")
    link = SharedLoadLink(None, subjects, malformed, lambda: [], router_id="me",  # type: ignore[arg-type]
                          clock=lambda: 0.0)
    await link._on_message(_Msg(subjects.router_load("me"), b"\x01garbage"))  # type: ignore[arg-type]
    assert malformed.total == 0
    await link._on_message(_Msg(subjects.router_load("peer"), b"\x01garbage"))  # type: ignore[arg-type]
    assert malformed.total == 1
