"""`tandem bench router`: the router's own cost, Tandem's router beside NVIDIA Dynamo's
frontend, both in front of engines at near-zero cost (sim `--sim-speedup 1000`, mocker
`--speedup-ratio 1000`), so what is measured is HTTP, tokenization, routing, the request
plane and SSE: requests/s, end-to-end latency and router CPU per request.

`main` parses flags and alternates the systems over rounds; `systems` starts each one;
`load` drives one phase with the serving bench's client; `report` turns phases into the
JSON document (pure)."""
