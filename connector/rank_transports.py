"""The transport agents of an engine whose ranks live in the worker's process (the sim): one
transport per rank, over that rank's region, and the peers they reach.

It is the data plane's `connector.lease_client.PeerRegistry`: adding a peer (its
`connector.kv_peer.KvPeer`, fetched from it once per incarnation) adds each of the peer's
rank agents to every local rank's transport, since any local rank may read from any of the
peer's ranks. It describes this worker to its peers the same way (`metadata`), and hands
the reader and the push writer their local ranks (`connector.shaped_read.LocalRank`), and
the load snapshot each rank's transfer counters (`rank_transfers`).
Built by `connector.sim.transport_builder.build_rank_transports`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from connector.agent_types import AgentStats
from connector.kv_geometry import KvShape
from connector.kv_peer import KvPeer, decode_peer, encode_peer
from connector.shaped_read import LocalRank
from connector.transport import KvTransport
from shared.schemas.load import RankTransfers


class RankTransports:
    def __init__(self, agent_name: str, shape: KvShape, regions: Sequence[np.ndarray],
                 transports: Sequence[KvTransport]) -> None:
        assert len(regions) == len(transports) == len(shape.ranks)
        self.agent_name = agent_name  # the worker's incarnation: what handles and targets name
        self.shape = shape
        self.transports = list(transports)
        self.local_ranks = [LocalRank(geometry, region.reshape(-1), transport)
                            for geometry, region, transport in zip(shape.ranks, regions, transports)]
        self._peers: dict[str, KvPeer] = {}

    @property
    def peer(self) -> KvPeer:
        """This worker as its peers see it."""
        return KvPeer(agent_name=self.agent_name, shape=self.shape,
                      rank_agents=[transport.agent_name for transport in self.transports],
                      rank_metadata=[transport.metadata() for transport in self.transports])

    def metadata(self) -> bytes:
        return encode_peer(self.peer)

    def rank_transfers(self) -> list[RankTransfers]:
        """Each rank's transfer counters so far, by rank (snapshots: reading them takes no lock)."""
        return [transport_stats(transport).of_rank(rank.rank)
                for rank, transport in zip(self.shape.ranks, self.transports)]

    # ---- PeerRegistry ----------------------------------------------------------------------

    def has_peer(self, name: str) -> bool:
        return name in self._peers

    def add_peer(self, name: str, metadata: bytes) -> None:
        """Reach a peer's every rank from every local rank; ValueError for metadata that does
        not describe `name` or that a transport refuses."""
        peer = decode_peer(metadata)
        if peer.agent_name != name:
            raise ValueError(f"metadata is for agent {peer.agent_name!r}, not {name!r}")
        for transport in self.transports:
            for agent, rank_metadata in zip(peer.rank_agents, peer.rank_metadata):
                transport.add_peer(agent, rank_metadata)
        self._peers[name] = peer

    def peer_of(self, name: str) -> KvPeer | None:
        return self._peers.get(name)

    def close(self) -> None:
        for transport in self.transports:
            transport.close()


def transport_stats(transport: KvTransport) -> AgentStats:
    """A transport's counters: the memory transport's `stats`, a NIXL transport's agent's
    (`NixlTransport._agent`, a `KvAgent`); zeros for a transport that counts nothing."""
    stats = getattr(transport, "stats", None)
    if stats is None:
        agent = getattr(transport, "_agent", None)  # NixlTransport: its KvAgent counts every transfer
        stats = getattr(agent, "stats", None)
    return stats if isinstance(stats, AgentStats) else AgentStats()
