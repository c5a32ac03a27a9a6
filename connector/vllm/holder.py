"""Holder side of the KV hand-off for a vLLM engine: leases on blocks vLLM keeps referenced.

The protocol is `connector.holder.LeaseHolder`'s (NATS request/reply on `kv.lease.<worker>`,
`connector.leases.LeaseTable` for lifetimes, a sweep that ends expired leases), but the
blocks live in vLLM's processes, so pinning is a message to the engine, not a call:

- a hold (`grant_held`): vLLM pinned the prompt's blocks when the prefill finished; the
  lease adopts that pin (a partial last block is the handle's `tail`, for the decode part);
- a prefix lease (`LeaseRequest`): the longest prefix the KV-event mirror knows is sent to
  vLLM as a pin control request, its blocks' own hashes (which take in a block's images and
  adapter; `connector.vllm.engine_hashes`) and its tokens; vLLM pins what is really still
  cached (the mirror may lag) and the lease covers that;
- a lease that ends (released, expired, cancelled at stop) unpins its key in vLLM.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from connector.holder import LeaseHolder
from connector.leases import Lease
from shared.bus import Bus
from shared.codec import MalformedCounter
from shared.schemas.transfer import KvHandle, KvTail
from shared.subjects import Subjects

if TYPE_CHECKING:
    from connector.vllm.engine_port import VllmKvEngine
    from connector.vllm.kv_link import HeldBlocks


class VllmKvHolder(LeaseHolder):
    def __init__(self, worker_id: str, bus: Bus, subjects: Subjects, engine: VllmKvEngine, *, compat_hash: str,
                 block_size: int, lease_ttl_s: float, sweep_interval_s: float = 0.1,
                 malformed: MalformedCounter | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(worker_id, bus, subjects, compat_hash=compat_hash, block_size=block_size,
                         lease_ttl_s=lease_ttl_s, sweep_interval_s=sweep_interval_s, malformed=malformed,
                         clock=clock)
        self._engine = engine
        self._pin_keys: dict[str, str] = {}  # lease id -> the key vLLM pinned its blocks under
        self._prefix_ids = itertools.count(1)

    def grant_held(self, reader_worker_id: str, held: HeldBlocks, block_hashes: list[int]) -> KvHandle:
        """Adopt the pin vLLM took when a prefill finished; the lease now decides its end. A
        partial last block goes in the handle's `tail`."""
        full = len(held.block_ids) - (1 if held.tail_tokens else 0)
        heads = len(held.checksums) // len(held.block_ids) if held.block_ids else 0
        handle = self._lease_pinned(reader_worker_id, held.key, held.block_ids[:full], block_hashes,
                                    held.checksums[:full * heads], self.lease_ttl_s)
        if not held.tail_tokens:
            return handle
        tail = KvTail(block_id=held.block_ids[full], checksums=held.checksums[full * heads:], tokens=held.tail_tokens)
        return msgspec.structs.replace(handle, tail=tail)

    async def grant_prefix(self, reader_worker_id: str, block_hashes: list[int], ttl_s: float) -> KvHandle | None:
        """Pin the longest prefix of `block_hashes` still cached in vLLM; None if there is none."""
        tokens = self._engine.prefix_tokens(block_hashes)
        if not tokens:
            return None
        link = self._engine.kv_link
        key = f"{self.worker_id}-prefix-{next(self._prefix_ids)}"
        block_ids = await link.pin_prefix(key, tokens, self._engine.prefix_blocks(block_hashes))
        if not block_ids:
            return None
        try:
            checksums = await link.block_checksums(block_ids)
        except BaseException:
            link.unpin_soon([key])
            raise
        return self._lease_pinned(reader_worker_id, key, block_ids, block_hashes, checksums, ttl_s)

    def _lease_pinned(self, reader_worker_id: str, key: str, block_ids: list[int], block_hashes: list[int],
                      checksums: list[int], ttl_s: float) -> KvHandle:
        handle = self._lease(reader_worker_id, block_ids, block_hashes, checksums, ttl_s)
        self._pin_keys[handle.lease_id] = key
        return handle

    def _unpin(self, ended: list[Lease]) -> None:
        keys = [self._pin_keys.pop(lease.lease_id) for lease in ended if lease.lease_id in self._pin_keys]
        if keys:
            self._engine.kv_link.unpin_soon(keys)

    @property
    def agent_name(self) -> str:
        return self._engine.kv_link.agent_name

    def agent_metadata(self) -> bytes:
        return self._engine.kv_link.agent_metadata
