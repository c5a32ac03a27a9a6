"""The router's KV room: which blocks each worker holds.

`index` (with `index_store`, `index_remove`, `index_match`, `index_runs`, `index_worker`,
`index_diff`, `index_results`) is the pure KV index: fed only by events, asked
`match(block_hashes)`; no I/O, no clock. `batch_decode` (pure) decodes a worker's batch for
it, without the token ids where the index does not read them.
`model_kv` (pure) is one model's namespace: its workers' index, prefix homes and recency.
`view` is their adapter: it subscribes to the workers' KV event streams, follows membership
(each worker in its model's namespace), asks for snapshots after a gap, and hands the
routing state (`flows.routing_state`) a model's namespace, which says how much of a prompt each of
its workers holds. Below the flows; beside `fleet`, which it never imports; above
`routing`, whose prefix homes and cache recency it keeps.
"""
