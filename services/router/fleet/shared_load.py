"""The other routers' predicted load, merged per worker (pure: no I/O, no clock; callers
pass `now` in).

Routers that serve behind one address (active-active replicas) each keep their own
predicted-load ledger (`routing.ledger`); without more, each would see only its own
share of the requests a worker was sent since its last load report. So every router
publishes its whole contribution (`RouterLoad`: in-flight requests and prompt tokens still
waiting for prefill, per worker) and merges its peers' here:

- `apply(message, now)`: a peer's newest full contribution replaces its previous one, a
  partial one replaces the figures of the workers it names (an older or duplicate `seq` is
  dropped; our own messages are ignored). A `leaving` message forgets the peer at once.
- `expire(now)`: a peer silent for `missed_heartbeats` of its own heartbeat periods is gone
  (the router died): its contribution no longer counts. So what is kept is bounded by the
  live peers and the workers they have something in flight on.
- `remote(worker_id)`: the peers' sum for one worker, what the worker pool adds to its own
  ledger's counts (`WorkerPool`, the adapter, with `shared_load_link` publishing and
  receiving on NATS).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.schemas import RoutedLoad, RouterLoad

MISSED_HEARTBEATS = 4  # a peer silent for this many of its heartbeat periods is gone
MIN_PEER_TTL_S = 1.0  # ... but never sooner than this (a very short period would flap)


@dataclass(frozen=True, slots=True)
class RemoteLoad:
    """What the other routers have on one worker."""

    in_flight: int = 0
    prefill_tokens: int = 0


NO_REMOTE_LOAD = RemoteLoad()


@dataclass(slots=True)
class _Peer:
    seq: int
    expires_at: float
    workers: dict[str, RemoteLoad]


class PeerLoads:
    def __init__(self, own_router_id: str, *, missed_heartbeats: int = MISSED_HEARTBEATS,
                 min_ttl_s: float = MIN_PEER_TTL_S) -> None:
        assert missed_heartbeats >= 1
        self.own_router_id = own_router_id
        self._missed = missed_heartbeats
        self._min_ttl_s = min_ttl_s
        self._peers: dict[str, _Peer] = {}
        self._totals: dict[str, RemoteLoad] = {}  # worker id -> sum over peers (workers with a non-zero sum only)
        self.stale = 0  # messages dropped as older than the last one of their router

    @property
    def peers(self) -> list[str]:
        return sorted(self._peers)

    def remote(self, worker_id: str) -> RemoteLoad:
        return self._totals.get(worker_id, NO_REMOTE_LOAD)

    def totals(self) -> dict[str, RemoteLoad]:
        """Every worker some peer has load on (a copy)."""
        return dict(self._totals)

    def apply(self, message: RouterLoad, now: float) -> bool:
        """Take a peer's contribution; True when the peer is new (it should hear ours soon)."""
        router_id = message.router_id
        if router_id == self.own_router_id:
            return False
        peer = self._peers.get(router_id)
        if peer is not None and message.seq <= peer.seq:
            self.stale += 1
            return False
        if message.leaving:
            self._forget(router_id)
            return False
        expires_at = now + max(self._min_ttl_s, self._missed * message.interval_s)
        is_new = peer is None
        if peer is None:
            peer = self._peers[router_id] = _Peer(message.seq, expires_at, {})
        peer.seq, peer.expires_at = message.seq, expires_at
        named = _contribution(message.workers)
        if message.full:
            replaced = peer.workers
            peer.workers = {worker_id: load for worker_id, load in named.items() if load != NO_REMOTE_LOAD}
        else:
            replaced = {worker_id: peer.workers[worker_id] for worker_id in named if worker_id in peer.workers}
            for worker_id, load in named.items():
                if load == NO_REMOTE_LOAD:
                    peer.workers.pop(worker_id, None)
                else:
                    peer.workers[worker_id] = load
        self._add(replaced, -1)
        self._add({worker_id: load for worker_id, load in named.items() if load != NO_REMOTE_LOAD}, +1)
        return is_new

    def expire(self, now: float) -> list[str]:
        """Forget the peers that fell silent; their ids."""
        gone = [router_id for router_id, peer in self._peers.items() if peer.expires_at <= now]
        for router_id in gone:
            self._forget(router_id)
        return gone

    def worker_left(self, worker_id: str) -> None:
        """A worker left the cluster: what peers had on it counts nowhere (their next message
        will not name it either)."""
        self._totals.pop(worker_id, None)
        for peer in self._peers.values():
            peer.workers.pop(worker_id, None)

    def _forget(self, router_id: str) -> None:
        peer = self._peers.pop(router_id, None)
        if peer is not None:
            self._add(peer.workers, -1)

    def _add(self, workers: dict[str, RemoteLoad], sign: int) -> None:
        for worker_id, load in workers.items():
            total = self._totals.get(worker_id, NO_REMOTE_LOAD)
            summed = RemoteLoad(total.in_flight + sign * load.in_flight,
                                total.prefill_tokens + sign * load.prefill_tokens)
            if summed == NO_REMOTE_LOAD:
                self._totals.pop(worker_id, None)
            else:
                self._totals[worker_id] = summed


def _contribution(workers: list[RoutedLoad]) -> dict[str, RemoteLoad]:
    """A message's per-worker figures (zeros included: a partial message's "nothing there
    now"); nonsense (negative counts) is taken as nothing."""
    merged: dict[str, RemoteLoad] = {}
    for entry in workers:
        in_flight, prefill_tokens = max(0, entry.in_flight), max(0, entry.prefill_tokens)
        previous = merged.get(entry.worker_id, NO_REMOTE_LOAD)
        merged[entry.worker_id] = RemoteLoad(previous.in_flight + in_flight, previous.prefill_tokens + prefill_tokens)
    return merged
