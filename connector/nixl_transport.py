"""`KvTransport` over a NIXL `KvAgent`: the real data plane (DRAM here, VRAM on GPUs).

NIXL reports a whole transfer as done or failed (a peer killed mid-way raises within
milliseconds after part of the data landed), so a failed transfer marks every block
failed: partly written blocks are garbage and must be computed. Byte-range transfers are
the agent's, with one flag for the whole transfer.
"""

from __future__ import annotations

import numpy as np

from connector.agent_types import KvAgentConfig
from connector.agent_types import TransferResult as AgentResult
from connector.nixl_agent import KvAgent
from connector.transport import Offsets, TransferResult


class NixlTransport:
    def __init__(self, agent_name: str, buffer: np.ndarray, block_nbytes: int, layer_nbytes: int, *,
                 progress_delay_us: int, transfer_timeout_s: float) -> None:
        self._agent = KvAgent(agent_name, KvAgentConfig(progress_delay_us=progress_delay_us,
                                                        default_timeout_s=transfer_timeout_s))
        self._agent.register_pool(buffer, block_nbytes)
        self._layer_nbytes = layer_nbytes

    @property
    def agent_name(self) -> str:
        return self._agent.name

    def metadata(self) -> bytes:
        return self._agent.metadata()

    def add_peer(self, name: str, metadata: bytes) -> None:
        self._agent.add_peer(name, metadata)

    def remove_peer(self, name: str) -> None:
        self._agent.remove_peer(name)

    def has_peer(self, name: str) -> bool:
        return name in self._agent.peers

    def close(self) -> None:
        self._agent.close()

    @staticmethod
    def _result(result: AgentResult, count: int) -> TransferResult:
        return TransferResult(outcome=result.outcome.value, ok=[result.ok] * count,
                              nbytes=result.nbytes if result.ok else 0, duration_s=result.elapsed_s,
                              reason=result.detail)

    async def read(self, peer: str, remote_block_ids: list[int], local_block_ids: list[int], *,
                   timeout_s: float) -> TransferResult:
        if not remote_block_ids:
            return TransferResult(outcome="done", ok=[])
        result = await self._agent.aread_blocks(peer, remote_block_ids, local_block_ids, timeout_s=timeout_s)
        return self._result(result, len(local_block_ids))

    async def write(self, peer: str, local_block_ids: list[int], remote_block_ids: list[int], *,
                    timeout_s: float, layer: int | None = None) -> TransferResult:
        if not remote_block_ids:
            return TransferResult(outcome="done", ok=[])
        if layer is None:
            result = await self._agent.awrite_blocks(peer, remote_block_ids, local_block_ids, timeout_s=timeout_s)
        else:
            result = await self._agent.awrite_layer(peer, remote_block_ids, local_block_ids,
                                                    layer_offset=layer * self._layer_nbytes,
                                                    layer_nbytes=self._layer_nbytes, timeout_s=timeout_s)
        return self._result(result, len(local_block_ids))

    async def read_ranges(self, peer: str, remote_offsets: Offsets, local_offsets: Offsets, lengths: Offsets, *,
                          timeout_s: float) -> TransferResult:
        result = await self._agent.aread_ranges(peer, remote_offsets, local_offsets, lengths, timeout_s=timeout_s)
        return self._result(result, 1)

    async def write_ranges(self, peer: str, remote_offsets: Offsets, local_offsets: Offsets, lengths: Offsets, *,
                           timeout_s: float) -> TransferResult:
        result = await self._agent.awrite_ranges(peer, remote_offsets, local_offsets, lengths, timeout_s=timeout_s)
        return self._result(result, 1)
