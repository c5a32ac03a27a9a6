"""The router: Tandem's OpenAI-compatible front door.

Contracts: `/v1/completions`, `/v1/chat/completions` (SSE streaming, usage, stop,
max_tokens, temperature/seed), `/v1/models`, `/health`, `/metrics`. Requests go whole to
one worker over the NATS request plane, chosen by `policy` from the membership bucket and
load snapshots that `worker_pool` mirrors.

Layout: `protocol` (OpenAI models), `errors` (error bodies), `policy` (pure routing),
`detokenizer` and `stop_strings` (pure text assembly), `worker_pool` (membership and
load, NATS adapter), `dispatch` (route and open a stream, re-route refusals),
`generation` (one request on one worker), `records` (outcomes, request events),
`serving*` (endpoints), `metrics`, `app` (routes and lifespan), `main` (uvicorn).
Started by `tandem router` via `run_router`.
"""
