"""Earlier KV event schemas, as a consumer built against them decodes today's events: the
tests that check a newer publisher stays readable by older consumers, and an older
publisher's events by today's (`test_kv_tiers`, `test_kv_event_packing`)."""

from __future__ import annotations

import msgspec


class FirstBlockStored(msgspec.Struct, tag="stored", kw_only=True):
    """`BlockStored` before tiers, adapters and packed token ids."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int] = []
    block_size: int
    chain_hashes: list[int] | None = None
