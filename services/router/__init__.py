"""The router: Tandem's OpenAI-compatible front door.

Contracts: `/v1/completions`, `/v1/chat/completions` (SSE streaming, usage, stop,
max_tokens, temperature/seed, and the decode-first `cache_hit_threshold`), `/v1/models`,
`/health`, `/metrics`. Requests go to one worker, or to a prefill then a decode worker,
over the NATS request plane, chosen by `routing` from the membership bucket, the load
snapshots that `fleet.worker_pool` mirrors, and the KV index that `kv.view` feeds from events.

Layout, in rooms whose arrows point down only (ARCHITECTURE.md, and a layers contract in
pyproject.toml): `http` (the FastAPI app and its lifespan, the generate endpoints' ASGI fast
path `generate_routes`, middleware, the serving classes, SSE framing) > `flows` (dispatch:
admit, then the generation; the routing state: route, predict, record; the source opener:
start the flow, resume on another worker; the flow executor; one-worker and
two-part token sources and their KV hand-offs; the generation with its pure detokenizer and
stop strings; records) > `fleet` (worker pool, shared load of router replicas, worker link)
| `kv` (the pure KV index and its bus adapter, `view`) | `openai` (protocol models, request
fields, error bodies, log-probabilities, tool calling) > `routing` (pure routing:
eligibility, cost model, the policy registry, plans, the predicted-load ledger). At the top:
`main` (the router's assembly, which wires the rooms, and uvicorn), `event_loop`, `config`,
`metrics`.
Started by `tandem router` via `run_router`.
"""
