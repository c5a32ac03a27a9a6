"""The router: Tandem's OpenAI-compatible front door.

Contracts: `/v1/completions`, `/v1/chat/completions` (SSE streaming, usage, stop,
max_tokens, temperature/seed, and the decode-first `cache_hit_threshold`), `/v1/models`,
`/health`, `/metrics`. Requests go to one worker, or to a prefill then a decode worker,
over the NATS request plane, chosen by `routing` from the membership bucket, the load
snapshots that `worker_pool` mirrors, and the KV index that `kv_view` feeds from events.

Layout: `protocol` (OpenAI models), `errors` (error bodies), `routing` (pure routing:
eligibility, cost model, the policy registry, plans, the predicted-load ledger),
`kv_index` (pure KV index) and `kv_view` (its bus adapter), `detokenizer` and
`stop_strings` (pure text assembly), `worker_pool` (membership and load, NATS adapter),
`dispatch` (route, predict, start the flow, resume on another worker), `flow` (the one
executor of any plan), `token_source` (one worker part), `two_part` and `handoff` (a
prefill and a decode part, KV pulled or pushed), `generation` (one request, across the
workers it needs), `records` (outcomes, request events), `serving*` (endpoints),
`metrics`, `app` (routes and lifespan), `main` (uvicorn).
Started by `tandem router` via `run_router`.
"""
