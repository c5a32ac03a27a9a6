"""Periodic load snapshot of one worker."""

from __future__ import annotations

import msgspec

from shared.schemas.common import Message


class TransferTotals(msgspec.Struct, kw_only=True, frozen=True):
    """One direction's transfers of one KV rank's transport agent since it started (the
    agent's `connector.agent_types.TransferCounts` on the wire). `transfers` counts every
    transfer whatever its outcome; `nbytes`, `seconds` and `descriptors` add up the done ones
    (nbytes / seconds is their throughput); `failed` and `cancelled` count the others."""

    transfers: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    descriptors: int = 0  # rows handed to the transport, after merging adjacent ones
    failed: int = 0
    cancelled: int = 0


class RankTransfers(msgspec.Struct, kw_only=True, frozen=True):
    """One rank of the worker's KV (`connector.kv_geometry.RankGeometry.rank`): its agent's
    reads (this rank pulled) and writes (it pushed) apart."""

    rank: int
    reads: TransferTotals = msgspec.field(default_factory=TransferTotals)
    writes: TransferTotals = msgspec.field(default_factory=TransferTotals)


class LoadSnapshot(Message, tag="load", kw_only=True):
    worker_id: str
    seq: int
    ts: float
    running: int  # requests in the batch (prefilling or decoding)
    waiting: int  # requests queued, not yet admitted
    kv_total_blocks: int
    kv_used_blocks: int  # blocks referenced by live requests
    kv_cached_blocks: int  # blocks holding reusable prefix content (incl. used ones)
    prompt_tokens_total: int  # cumulative, for hit-rate over any window
    cached_tokens_total: int  # cumulative prompt tokens served from the prefix cache
    generated_tokens_total: int
    pending_prefill_tokens: int  # uncached prompt tokens not yet computed
    active_leases: int = 0  # KV hand-offs this worker holds blocks for
    kv_pulled_tokens_total: int = 0
    kv_recomputed_tokens_total: int = 0
    kv_blocks_retried_total: int = 0  # blocks read again after a failed transfer or verification
    kv_blocks_recovered_total: int = 0  # of those, blocks that then arrived and verified
    kv_blocks_recomputed_total: int = 0  # blocks meant to arrive by transfer that were computed
    computed_prompt_tokens_total: int = 0  # prompt tokens actually computed (not reused, not received)
    external_prompt_tokens_total: int = 0  # prompt tokens the engine took from a KV transfer (vLLM's count)
    kv_evicted_blocks_total: int = 0  # cached blocks evicted to make room
    kv_evicted_missed_blocks_total: int = 0  # blocks a request missed that had been evicted here
    # Each KV rank's transfer counters, by rank (none from a worker without a KV data plane;
    # a vLLM worker's from its model workers' latest pull and push reports)
    kv_ranks: list[RankTransfers] = []
