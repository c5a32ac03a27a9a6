"""The simulated engine: paged KV blocks with prefix caching, continuous batching with
chunked prefill, a timing profile, deterministic tokens and real KV bytes in DRAM.

Modules: `profile` (timing model), `block_manager` (block pool, prefix cache, KV events;
`announcer` orders its `BlockStored` events parents first), `kv_pool` (KV bytes), `tokens`
(next-token function), `request` (one request's tokens, blocks and computed position; pure),
`scheduler` (one engine step; pure; `admission` admits a waiting request), `kv_port` (pins
and received blocks for the KV data plane; pure), `engine` (`SimEngine`, the asyncio
adapter implementing `services.worker.engine.Engine` and `connector.port.KvPort`).
Only `engine` does I/O (sleeping); everything else is pure and synchronous.
"""
