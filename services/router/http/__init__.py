"""The router's HTTP entrances: the OpenAI API over HTTP, and how an answer is framed.

`app.create_app(config, assembly)` builds the FastAPI app (its lifespan has the router's
assembly, `main.RouterAssembly`, start the fleet, the KV view and the flows and hand back
what the entrances serve from: this room constructs none of them; `/v1/models`, `/health`,
`/ready`, `/metrics`, `/tokenize`, `/v1/responses`) and stacks
its ASGI middleware: `tracing` (the request's HTTP span), `auth` (API keys and their
limits), `input` (content type, body size and depth), then `generate_routes`, the fast path
that serves nearly all traffic: `POST /v1/completions` and `/v1/chat/completions` decoded
with msgspec and handed to the serving classes without FastAPI's routing. `serving` (with
`serving_completions`, `serving_chat`, `serving_tokenize`, `choices`, `model_cards`)
checks and tokenizes a request, opens its `flows.generation` through the dispatcher, and
answers it as one JSON body or as an SSE stream (`sse`). The top room: it may import every
other room, and no room imports it (only `main` does).
"""
