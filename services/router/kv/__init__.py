"""The router's KV room: which blocks each worker holds.

`index` (with `index_store`, `index_match`, `index_runs`, `index_worker`, `index_diff`,
`index_results`) is the pure KV index: fed only by events, asked `match(block_hashes)`; no
I/O, no clock. `batch_decode` (pure) decodes a worker's batch for it, without the token ids
where the index does not read them.
`view` is its adapter: it subscribes to the workers' KV event streams, follows membership,
asks for snapshots after a gap, and answers the dispatcher (`flows.dispatch`) how much of a
prompt each worker holds. Below the flows; beside `fleet`, which it never imports; above
`routing`, whose prefix homes and cache recency it keeps.
"""
