"""What a worker tells its peers about its KV: its shape and one transport agent per rank
(pure data).

A holder answers an `AgentInfoRequest` with its `KvPeer`, msgpack-encoded, in
`AgentInfo.metadata`; a push reader's is fetched the same way by the writer. The peer's
worker-level `agent_name` is what handles and push targets name (fresh per incarnation,
so a restarted worker is a new peer); each rank has its own transport agent
(`rank_agents[r]`, whose transport metadata is `rank_metadata[r]`), which every local rank
that reads from it adds as its own peer. The shape (`connector.kv_geometry.KvShape`) says
where each block, layer and head lives in each rank's region, so a reader plans its reads
alone (`connector.range_plan`).
"""

from __future__ import annotations

import msgspec

from connector.kv_geometry import KvShape
from shared.codec import Codec, encode
from shared.schemas.common import Message


class KvPeer(Message, kw_only=True):
    agent_name: str
    shape: KvShape
    rank_agents: list[str]
    rank_metadata: list[bytes]

    def validate(self) -> None:
        self.shape.validate()
        if not len(self.rank_agents) == len(self.rank_metadata) == len(self.shape.ranks):
            raise ValueError(f"peer {self.agent_name!r} describes {len(self.shape.ranks)} ranks but names "
                             f"{len(self.rank_agents)} agents")
        if [rank.rank for rank in self.shape.ranks] != list(range(len(self.shape.ranks))):
            raise ValueError(f"peer {self.agent_name!r}: ranks must be numbered 0..{len(self.shape.ranks) - 1}")


def rank_agent_name(agent_name: str, rank: int) -> str:
    """The transport agent of one rank of a worker's incarnation."""
    return f"{agent_name}-r{rank}"


_codec: Codec[KvPeer] = Codec(KvPeer)


def encode_peer(peer: KvPeer) -> bytes:
    return encode(peer)


def decode_peer(metadata: bytes) -> KvPeer:
    """The peer a metadata blob describes; ValueError for anything else (a reader treats the
    holder as unreachable)."""
    try:
        peer = _codec.decode(metadata)
    except msgspec.DecodeError as error:
        raise ValueError(f"not a Tandem KV peer description: {error}") from error
    peer.validate()
    return peer
